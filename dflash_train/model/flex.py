"""Training attention with flex attention: the block mask of the training mask and the one compiled call.

One call covers every block of a packed micro-batch, all heads at once (keys/values keep their
own heads: GQA is the kernel's, not a repeated copy):

    queries [Q_pad]          block rows n*B + k (n < N), then padding rows
    keys    [T_pad + Q_pad]  context 0..T-1, padding up to T_pad, then the block rows, padding

Shapes. A compiled kernel is specialised to its shapes (and to the layer kind and the grad mode),
and every micro-batch has its own T and N. The context is padded to one length for the whole run:
the bucket (`bucket`: 128 x {1, 2, 3, 4, 6, 8, 12, ...}) of the micro-batch token budget (`ctx_len`;
packed rows fill it nearly, and the training and held-out micro-batches share it); only a row longer
than the budget makes another. The query rows N*B, which vary more, are padded to a power of two
times 128 (`query_bucket`), so a run sees about two or three query sizes for training and as many
for the held-out check: with one layer kind well under ten compiles in all (counted by
tests/unit/train/test_loop.py). Padding rows see no key and no query sees a padding key; flex
attention skips the tiles a block mask leaves empty, so padding costs the memory of the padded
q/k/v, not attention work.

Block mask. Built on the device, once per micro-batch, from per-tile intervals (a row sees the
context span [doc_start, anchor) and its own block's key rows), never from the [Q, K] mask:
[Q_pad, T_pad/128] interval tests for the context and one contiguous key-tile range per query
tile for the blocks. A tile is "full" (the kernel skips mask_mod there) only when every row of the
query tile sees every key of the tile; everything else that any row sees is "partial" and masked
exactly by `mask_mod`. No value is read back to the host.

Eager flex attention materialises the scores (out of memory at real shapes), so the kernel runs
only through `torch.compile(fullgraph=True)`: `_flex_call` refuses to run uncompiled, and
fullgraph turns a recompile-limit hit into an error instead of a silent eager fallback.
"""

from __future__ import annotations

import torch

TILE = 128  # flex attention's sparse block size (query and key tiles)
MAX_SHAPES = 64  # compiled shapes allowed per run (bucket pairs); more is a bug, not a slowdown


def bucket(n: int) -> int:
    """Smallest length >= n of the form TILE * {1, 2, 3, 4, 6, 8, 12, 16, 24, ...}: beyond rounding to a
    tile, at most a third of the bucket is padding; 18 sizes cover 128 .. 65536."""
    m = max(1, -(-int(n) // TILE))
    p = 1
    while True:
        if p >= m:
            return p * TILE
        if p >= 2 and 3 * p // 2 >= m:
            return 3 * p // 2 * TILE
        p *= 2


def query_bucket(n: int) -> int:
    """Smallest TILE * 2^k >= n: the padded query length (at most half of it padding)."""
    m = max(1, -(-int(n) // TILE))
    return TILE << (m - 1).bit_length()


def _pad(x: torch.Tensor, length: int, value) -> torch.Tensor:
    if x.shape[0] == length:
        return x
    return torch.cat([x, x.new_full((length - x.shape[0], *x.shape[1:]), value)])


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[Qt, Kt] bool -> (count [1, 1, Qt], column indices [1, 1, Qt, Kt]) with the set columns first."""
    t = tiles.to(torch.int32)
    order = torch.argsort(t, dim=-1, descending=True, stable=True)
    return t.sum(-1).to(torch.int32)[None, None], order.to(torch.int32)[None, None].contiguous()


def training_block_mask(anchors: torch.Tensor, doc_start: torch.Tensor, ctx_positions: torch.Tensor,
                        block_positions: torch.Tensor, window: int | None, ctx_len: int | None = None):
    """The BlockMask of the training mask (training.md) for one packed micro-batch, on the layout's
    device, with lengths padded to buckets: Q_LEN = query_bucket(N*B), KV_LEN = bucket(max(T, ctx_len))
    + Q_LEN (`ctx_len`: the run's micro-batch token budget, so every micro-batch shares one)."""
    from torch.nn.attention.flex_attention import BlockMask

    n, b = block_positions.shape
    t = ctx_positions.shape[0]
    t_pad, q_pad = bucket(max(t, ctx_len or 0)), query_bucket(n * b)
    dev = anchors.device
    rows = n * b
    # per query row: its block, its visible context span [lo, hi), its position (padding rows: none)
    q_blk = _pad(torch.arange(rows, device=dev) // b, q_pad, -1)
    k_blk = _pad(torch.arange(rows, device=dev) // b, q_pad, -2)
    lo = _pad(doc_start[:, None].expand(n, b).reshape(-1), q_pad, 0)
    hi = _pad(anchors[:, None].expand(n, b).reshape(-1), q_pad, 0)
    q_pos = _pad(block_positions.reshape(-1), q_pad, 0)
    ctx_pos = _pad(ctx_positions, t_pad, 0)

    def mask_mod(_b, _h, qi, ki):
        is_ctx = ki < t_pad
        kc = ki.clamp(max=t_pad - 1)
        ctx_ok = is_ctx & (kc >= lo[qi]) & (kc < hi[qi])
        kb = (ki - t_pad).clamp(min=0)
        blk_ok = (~is_ctx) & (k_blk[kb] == q_blk[qi])
        if window is not None:
            ctx_ok = ctx_ok & (q_pos[qi] - ctx_pos[kc] < window)
            blk_ok = blk_ok & (kb % b <= qi % b)
        return ctx_ok | blk_ok

    qt, kt_ctx, kt = q_pad // TILE, t_pad // TILE, (t_pad + q_pad) // TILE
    # context tiles: a row sees tile j when [lo, hi) meets [j*TILE, (j+1)*TILE); the tile is full for
    # the query tile when every row's span covers it (padding rows cover nothing, so never full)
    start = torch.arange(kt_ctx, device=dev) * TILE
    meets = (lo[:, None] < start + TILE) & (hi[:, None] > start) & (hi > lo)[:, None]
    covers = (lo[:, None] <= start) & (hi[:, None] >= start + TILE)
    ctx_any = meets.view(qt, TILE, kt_ctx).any(1)
    ctx_full = covers.view(qt, TILE, kt_ctx).all(1)
    if window is not None:  # the window cuts inside tiles: mask every visible tile exactly
        ctx_full = torch.zeros_like(ctx_full)
    # block tiles: query tile i holds blocks first..last, whose key rows are [first*B, (last+1)*B)
    i = torch.arange(qt, device=dev)
    has_rows = i * TILE < rows
    first = (i * TILE) // b
    last = ((i * TILE + TILE).clamp(max=max(rows, 1)) - 1) // b
    lo_tile, hi_tile = (first * b) // TILE, ((last + 1) * b - 1) // TILE
    m = torch.arange(kt - kt_ctx, device=dev)
    blk_any = has_rows[:, None] & (m >= lo_tile[:, None]) & (m <= hi_tile[:, None])
    full = torch.cat([ctx_full, torch.zeros_like(blk_any)], dim=1)
    partial = torch.cat([ctx_any & ~ctx_full, blk_any], dim=1)
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=TILE, mask_mod=mask_mod,
                                    seq_lengths=(q_pad, t_pad + q_pad))


def _flex_call(q, k, v, block_mask, scale):
    if not torch.compiler.is_compiling():  # traced away when compiled; reached only if run eagerly
        raise RuntimeError("flex attention reached eager mode (torch.compile disabled?); eager flex "
                           "materialises the scores: use objective.attention: split instead")
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


_COMPILED = None


def compiled_flex():
    """The one compiled flex-attention call (static shapes per bucket, whole graph or an error)."""
    global _COMPILED
    if _COMPILED is None:
        import torch._dynamo

        # each bucket pair is one cache entry of this function; the default limit (8) is too low
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_SHAPES)
        _COMPILED = torch.compile(_flex_call, fullgraph=True, dynamic=False)
    return _COMPILED


def attention_dtype(q: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The one dtype flex attention gets q, k and v in (the kernel refuses a mix). Under torch.autocast
    (`engine.precision: bf16-mixed`) q and k leave RMSNorm and RoPE in fp32 while v comes out of its
    linear layer in bf16: all three take the autocast dtype, as an autocast matmul would. Otherwise
    they share the weights' dtype already, and v's is kept."""
    dev = q.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return v.dtype


def flex_training_attention(q, k_blk, v_blk, ctx_k, ctx_v, block_mask, scale: float) -> torch.Tensor:
    """q/k_blk/v_blk [N, H*, B, d], ctx_k/v [Hkv, T, d] (keys/values not repeated for GQA) -> [N, Hq, B, d]."""
    dtype = attention_dtype(q, v_blk)
    q, k_blk, v_blk, ctx_k, ctx_v = (x.to(dtype) for x in (q, k_blk, v_blk, ctx_k, ctx_v))
    n, h, b, d = q.shape
    hkv, t = ctx_k.shape[0], ctx_k.shape[1]
    q_pad, kv_len = block_mask.seq_lengths
    t_pad = kv_len - q_pad
    rows = n * b
    qq = q.transpose(0, 1).reshape(h, rows, d)
    qq = torch.cat([qq, qq.new_zeros(h, q_pad - rows, d)], dim=1)[None]

    def keys(ctx, blk):
        zc, zb = ctx.new_zeros(hkv, t_pad - t, d), ctx.new_zeros(hkv, q_pad - rows, d)
        return torch.cat([ctx, zc, blk.transpose(0, 1).reshape(hkv, rows, d), zb], dim=1)[None]

    o = compiled_flex()(qq, keys(ctx_k, k_blk), keys(ctx_v, v_blk), block_mask, scale)
    return o[0, :, :rows].reshape(h, n, b, d).transpose(0, 1)
