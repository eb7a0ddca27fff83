"""The DFlash drafter, top to bottom: norm, rotary, MLP, attention, layer, model.

A stack of Qwen3-style layers reading the target's hidden states (formats.md §1):

    ctx   = hidden_norm(fc(concat(aux target hidden states)))        # context, never updated
    h     = target_embed([last verified token, MASK x (B-1)])        # one block at p..p+B-1
            (a drafter with its own `mask_embedding`, vLLM's mask_embedding.pt, puts it at the MASK slots)
    layer: q from the block (after input_layernorm); keys/values = [proj(ctx) ; proj(block)]
           (k_norm over both, RoPE at absolute positions); non-causal inside the block
    logits = lm_head(norm(h))  (the target's LM head, or a reduced-vocab head + d2t)

Slot k of a block predicts the token at its own position p + k.

Two entry points share every weight and every formula:
- `forward_block`: inference, one block per sequence, with a context K/V cache that grows as
  tokens are accepted (`append_context`) and is cropped on rejection (`DFlashCache.crop`).
- `forward_train`: many blocks per packed sequence at given anchors under the training mask
  (a block sees context strictly before its anchor in its own document, itself fully, and no
  other block). `attention` picks the kernel: "split" (exact context x block split, no dense
  mask; the CPU default), "dense" (the naive dense-mask reference), "flex" (compiled flex
  attention with a tile-level block mask, model/flex.py; the GPU default); the layout is
  model/train_layout.py's. With
  `activation_checkpointing` set, each layer keeps only its input and recomputes the rest in
  the backward; with `use_fused_ops(True)`, RMSNorm, SwiGLU and RoPE run compiled (model/fused_ops.py).
Attribute names are the checkpoint tensor names, so state_dict() is the checkpoint (but for
`mask_embedding`, which checkpoints keep in a file of its own: model/checkpoint.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from dflash_train.model import fused_ops, row_buckets
from dflash_train.model.config import DFlashConfig
from dflash_train.model.fused_ops import rotate_half
from dflash_train.model.train_layout import GridRuns, TrainLayout, dense_training_mask

# split attention computes all runs in one padded grid up to this many scores (runs x blocks a run x heads x
# queries a block x context span: ~5M for a CPU demo micro-batch of 1,024 tokens; 64 MiB in fp32), run by run
# past it (a long-document GPU batch, the every-position check)
SPLIT_GRID_ELEMENTS = 1 << 24
# ... and while the grid's padding (its scores beyond those the runs compute one by one) stays under this many
# scores per run it saves: on 2 Zen 4 cores a run's own dozen ops cost ~2 ms, ~250K padded scores about as much
# (runs of one long document, whose spans grow run by run, stay run by run: the grid was 1.1-1.3x slower there)
SPLIT_GRID_PADDING_PER_RUN = 250_000


class DFlashRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = False  # model/fused_ops.py instead (DFlashDraftModel.use_fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return fused_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DFlashRotary(nn.Module):
    """RoPE tables computed for arbitrary absolute positions."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        rope = config.rope
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            dim = config.head_dim
            inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            scaling = 1.0
        else:  # llama3, yarn, ...: let transformers compute the frequencies
            from transformers import Qwen3Config
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf = Qwen3Config(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                             head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
                             rope_parameters=dict(rope))
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, n, d]; cos/sin [..., n, d] broadcast over heads."""
    return x * cos.unsqueeze(-3) + rotate_half(x) * sin.unsqueeze(-3)


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = row_buckets.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = row_buckets.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = row_buckets.Linear(config.intermediate_size, config.hidden_size, bias=False)
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {config.hidden_act!r}: DFlash drafters use silu")
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(fused_ops.swiglu(gate, up) if self.fused else F.silu(gate) * up)


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.fused = False
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        self.window = config.sliding_window if config.layer_type(layer_idx) == "sliding_attention" else None
        bias = config.attention_bias
        self.q_proj = row_buckets.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = row_buckets.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = row_buckets.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = row_buckets.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    # projections -----------------------------------------------------------------------------
    def _heads(self, x: torch.Tensor, n_heads: int, norm: DFlashRMSNorm | None = None) -> torch.Tensor:
        """[..., n, heads*d] -> [..., heads, n, d]; `norm` (per head) runs first, on contiguous rows"""
        x = x.unflatten(-1, (n_heads, self.head_dim))
        return (x if norm is None else norm(x)).transpose(-2, -3)

    def project_queries(self, h, cos, sin):
        rope = fused_ops.apply_rope if self.fused else apply_rope
        return rope(self._heads(self.q_proj(h), self.num_heads, self.q_norm), cos, sin)

    def project_kv(self, x, cos, sin):
        rope = fused_ops.apply_rope if self.fused else apply_rope
        k = rope(self._heads(self.k_proj(x), self.num_kv_heads, self.k_norm), cos, sin)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        return k, v

    def _expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.num_heads // self.num_kv_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=-3)

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.transpose(-2, -3).flatten(-2))

    # inference: one block per sequence against cached context K/V -----------------------------
    def forward_block(self, h, cos, sin, ctx_k, ctx_v, ctx_positions, block_positions):
        """h [b, B, H]; ctx_k/v [b, Hkv, P, d] (already normed and rotated)."""
        q = self.project_queries(h, cos, sin)
        k_blk, v_blk = self.project_kv(h, cos, sin)
        if ctx_k is None:  # a block at the very start of a sequence has no context yet
            ctx_k, ctx_v = k_blk[..., :0, :], v_blk[..., :0, :]
            ctx_positions = block_positions[:, :0]
        k = self._expand_kv(torch.cat([ctx_k, k_blk], dim=-2))
        v = self._expand_kv(torch.cat([ctx_v, v_blk], dim=-2))
        mask = None
        if self.window is not None:
            b_len = h.shape[-2]
            ctx_ok = (block_positions[:, :, None] - ctx_positions[:, None, :]) < self.window
            blk_ok = torch.ones(b_len, b_len, dtype=torch.bool, device=h.device).tril()
            mask = torch.cat([ctx_ok, blk_ok.expand(h.shape[0], -1, -1)], dim=-1)[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self._out(o)

    # training: many blocks over a packed context ----------------------------------------------
    def forward_train(self, h, cos, sin, ctx_k, ctx_v, layout: TrainLayout, attention: str, first_query: int = 0,
                      end_query: int | None = None):
        """h [N, B, H]; ctx_k/v [Hkv, T, d]. Returns [N, end_query - first_query, H]: the outputs of slots
        first_query..end_query - 1 (end_query None: B; every slot's keys and values are still read). Split
        attention computes only those slots' queries; flex and dense compute every slot and keep those."""
        k_blk, v_blk = self.project_kv(h, cos, sin)  # [N, Hkv, B, d]
        end = h.shape[1] if end_query is None else end_query
        q_from, q_to = (first_query, end) if attention == "split" else (0, h.shape[1])
        q = self.project_queries(h[:, q_from:q_to], cos[:, q_from:q_to], sin[:, q_from:q_to])  # [N, Hq, q_to-q_from, d]
        if attention == "flex":  # the kernel reads the shared kv heads itself (GQA)
            from dflash_train.model.flex import flex_training_attention

            o = flex_training_attention(q, k_blk, v_blk, ctx_k, ctx_v, layout.flex_mask(self.window), self.scale)
            return self._out(o[:, :, first_query:end])
        # split and dense, like flex, take the shared kv heads: each expands them only where it needs to
        if attention == "split":
            return self._out(self._split_attention(q, k_blk, v_blk, ctx_k, ctx_v, layout, q_from, q_to))
        if attention == "dense":
            return self._out(self._dense_attention(q, k_blk, v_blk, ctx_k, ctx_v, layout)[:, :, first_query:end])
        raise ValueError(f"attention {attention!r}: choose split, dense or flex")

    def _split_attention(self, q, k_blk, v_blk, ctx_k, ctx_v, layout, q_from: int = 0, q_to: int | None = None):
        """Exact attention without the dense mask: one softmax over [own context ; own block].

        Blocks are taken a run at a time (`layout.segments()`: at most `chunk_blocks` blocks of
        one document): scores against the visible context span are [n, Hq, B, c1-c0] with the
        anchor cutoff as a mask, scores against the own block are [n, Hq, B, B]. Concatenating
        the two and normalising once is the same softmax as the dense reference, never building
        the [N*B, T + N*B] mask and never scoring a block against another document. While the
        runs padded side by side stay under `SPLIT_GRID_ELEMENTS` scores and their padding under
        `SPLIT_GRID_PADDING_PER_RUN` a run, all runs are computed at once (`_attend_grid`: a few
        batched ops instead of a dozen per run, which is what a CPU step of many short documents
        waited on); otherwise each run is computed on its own and, when
        gradients are needed, checkpointed: its scores and probabilities are freed after the
        forward and recomputed in the backward, so memory holds one run's scores, not every
        block's. `q` holds the queries of slots q_from..q_to - 1 only (q_to None: to the block's end); the keys and
        values keep their shared heads (`_attend_grid` reads them as they are, the runs one by one expand them).
        """
        q_to = k_blk.shape[-2] if q_to is None else q_to
        blk_ok = layout.block_allowed(self.window)
        blk_ok = None if blk_ok is None else blk_ok[q_from:q_to]
        if layout.grid is not None:  # a grid built beforehand in shapes that do not pin a compiled graph
            return self._attend_grid(q, k_blk, v_blk, ctx_k, ctx_v, layout.grid, q_from, blk_ok, q_to)
        runs, per_run, span, run_pairs = layout.grid_size()  # host numbers: the grid is built only when taken
        per_pair = q.shape[1] * q.shape[2]  # scores per (block, context token): heads x queries
        grid = runs * per_run * max(1, span) * per_pair
        if runs and grid <= SPLIT_GRID_ELEMENTS and (
                grid - run_pairs * per_pair <= (runs - 1) * SPLIT_GRID_PADDING_PER_RUN):
            return self._attend_grid(q, k_blk, v_blk, ctx_k, ctx_v,
                                     layout.padded_runs(self.window, bucket=row_buckets.compiles_per_shape(q)),
                                     q_from, blk_ok, q_to)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_blk, v_blk, ctx_k, ctx_v))
        ctx_k, ctx_v, k_blk, v_blk = (self._expand_kv(x) for x in (ctx_k, ctx_v, k_blk, v_blk))
        outs = []
        for lo, hi, c0, c1 in layout.segments():
            allowed = layout.context_allowed(self.window, lo, hi, c0, c1)[:, :, q_from:q_to]
            args = (q[lo:hi], k_blk[lo:hi], v_blk[lo:hi], ctx_k[:, c0:c1], ctx_v[:, c0:c1], allowed, blk_ok)
            if grad:
                outs.append(torch.utils.checkpoint.checkpoint(self._attend_run, *args, use_reentrant=False))
            else:
                outs.append(self._attend_run(*args))
        return torch.cat(outs, dim=0)

    def _attend_grid(self, q, k_blk, v_blk, ctx_k, ctx_v, grid: GridRuns, q_from, blk_ok, q_to=None):
        """Every run at once: the blocks' queries scattered into a grid of runs, scored against each run's
        context span gathered into [R, Hkv, L, d], the scores gathered back per block for the same one softmax
        over [own context ; own block] as `_attend_run`, and the probabilities scattered into the grid again for
        the values. The keys and values keep their Hkv shared heads: the query heads of one kv head sit side by
        side in the grid ([R, Hkv, groups * P * B, d]), so the context gathered, and its gradient's index_add, are
        Hkv heads, not Hq (on 2 AMX cores a layer's grid 9 ms forward and backward instead of 12, Hq 9, Hkv 3).
        q [N, Hq, Bq, d], k_blk/v_blk [N, Hkv, B, d], ctx_k/v [Hkv, T, d] -> [N, Hq, Bq, d]. The grid's runs
        and span are read from its tensors' shapes (a compiled step keeps them symbolic), its blocks a run
        from `grid.per_run`."""
        rows, ctx_index, ctx_ok, per_run = grid.rows, grid.ctx_index, grid.ctx_ok, grid.per_run
        runs, span = ctx_index.shape
        n, h, bq, d = q.shape
        kv = k_blk.shape[1]
        groups = h // kv

        def to_grid(x):  # [N, Hq, bq, e] -> [R, Hkv, groups * P * bq, e]
            grid = x.new_zeros(runs * per_run, *x.shape[1:]).index_copy(0, rows, x)
            return grid.view(runs, per_run, kv, groups, bq, -1).permute(0, 2, 3, 1, 4, 5).reshape(
                runs, kv, groups * per_run * bq, -1)

        def from_grid(x):  # [R, Hkv, groups * P * bq, e] -> [N, Hq, bq, e]
            return x.view(runs, kv, groups, per_run, bq, -1).permute(0, 3, 1, 2, 4, 5).reshape(
                runs * per_run, h, bq, -1).index_select(0, rows)

        # index_select, not ctx_k[:, ctx_index]: its backward (index_add) is ~4x faster on a CPU than indexing's
        flat = ctx_index.flatten()
        kc = ctx_k.index_select(1, flat).unflatten(1, ctx_index.shape).transpose(0, 1)  # [R, Hkv, L, d]
        vc = ctx_v.index_select(1, flat).unflatten(1, ctx_index.shape).transpose(0, 1)
        s_ctx = from_grid(to_grid(q) @ kc.mT) * self.scale
        s_ctx = s_ctx.masked_fill(~ctx_ok[:, :, q_from:q_to], float("-inf"))
        s_blk = (q.reshape(n, kv, groups * bq, d) @ k_blk.mT).view(n, h, bq, -1) * self.scale
        if blk_ok is not None:
            s_blk = s_blk.masked_fill(~blk_ok, float("-inf"))
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1).float(), dim=-1).to(q.dtype)
        o_blk = (p[..., span:].reshape(n, kv, groups * bq, -1) @ v_blk).view(n, h, bq, d)
        return from_grid(to_grid(p[..., :span]) @ vc) + o_blk

    def _attend_run(self, q, k_blk, v_blk, kc, vc, ctx_allowed, blk_allowed):
        """One run of blocks: q/k_blk/v_blk [n, Hq, B, d], kc/vc [Hq, t, d] -> [n, Hq, B, d]."""
        s_ctx = torch.einsum("nhbd,htd->nhbt", q, kc) * self.scale
        s_ctx = s_ctx.masked_fill(~ctx_allowed, float("-inf"))
        s_blk = torch.einsum("nhbd,nhcd->nhbc", q, k_blk) * self.scale
        if blk_allowed is not None:
            s_blk = s_blk.masked_fill(~blk_allowed, float("-inf"))
        t = kc.shape[-2]
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1).float(), dim=-1).to(q.dtype)
        return torch.einsum("nhbt,htd->nhbd", p[..., :t], vc) + torch.einsum("nhbc,nhcd->nhbd", p[..., t:], v_blk)

    def _dense_attention(self, q, k_blk, v_blk, ctx_k, ctx_v, layout):
        """The naive reference: all blocks as one query set, keys [context ; all blocks] (kv heads expanded)."""
        ctx_k, ctx_v, k_blk, v_blk = (self._expand_kv(x) for x in (ctx_k, ctx_v, k_blk, v_blk))
        n, h, b, d = q.shape
        t = ctx_k.shape[-2]
        qq = q.transpose(0, 1).reshape(h, n * b, d)
        kk = torch.cat([ctx_k, k_blk.transpose(0, 1).reshape(h, n * b, d)], dim=-2)
        vv = torch.cat([ctx_v, v_blk.transpose(0, 1).reshape(h, n * b, d)], dim=-2)
        mask = dense_training_mask(layout, self.window)  # [N*B, T + N*B]
        assert mask.shape == (n * b, t + n * b)
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=self.scale)
        return o.reshape(h, n, b, d).transpose(0, 1)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.dropout = 0.0  # on the residual branches in training mode; eval mode (checks, decoding) reads them whole

    def _drop(self, x):
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    def _mlp_residual(self, h):
        return h + self._drop(self.mlp(self.post_attention_layernorm(h)))

    def forward_block(self, h, cos, sin, ctx_k, ctx_v, ctx_positions, block_positions):
        h = h + self._drop(self.self_attn.forward_block(self.input_layernorm(h), cos, sin, ctx_k, ctx_v,
                                                        ctx_positions, block_positions))
        return self._mlp_residual(h)

    def forward_train(self, h, cos, sin, ctx_k, ctx_v, layout, attention, first_query: int = 0,
                      end_query: int | None = None):
        """[N, B, H] -> [N, end_query - first_query, H]: the outputs of slots first_query..end_query - 1 (None: B)."""
        h = h[:, first_query:end_query] + self._drop(self.self_attn.forward_train(
            self.input_layernorm(h), cos, sin, ctx_k, ctx_v, layout, attention, first_query, end_query))
        return self._mlp_residual(h)


class DFlashCache:
    """Per-layer context K/V for inference; grows with accepted tokens, cropped on rejection."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None  # [b, P]

    @property
    def length(self) -> int:
        return 0 if self.positions is None else self.positions.shape[-1]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k if old_k is None else torch.cat([old_k, k], dim=-2)
        self.values[layer] = v if old_v is None else torch.cat([old_v, v], dim=-2)

    def crop(self, length: int) -> None:
        """Keep the first `length` context positions."""
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=False)):
            if k is not None:
                self.keys[i], self.values[i] = k[..., :length, :], v[..., :length, :]
        if self.positions is not None:
            self.positions = self.positions[..., :length]


class DFlashDraftModel(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = row_buckets.Linear(config.num_aux_layers * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = DFlashRotary(config)
        if config.reduced_vocab:
            self.lm_head = row_buckets.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        else:
            self.lm_head = None
        self.activation_checkpointing = False  # training memory switch (engine.activation_checkpointing)
        # the MASK slots' input [H_target] where the drafter has its own (learn_mask_embedding, or a checkpoint's
        # mask_embedding.pt); None: the target's embedding row of mask_token_id, as every engine reads it
        self.register_parameter("mask_embedding", None)
        # borrowed from the target, frozen and never saved: kept off the module tree
        self._target_embed: torch.Tensor | None = None
        self._target_lm_head: torch.Tensor | None = None

    def set_dropout(self, p: float) -> None:
        """Dropout at rate `p` on each layer's attention and MLP outputs in training mode (objective.dropout)."""
        for layer in self.layers:
            layer.dropout = float(p)

    def use_fused_ops(self, on: bool = True) -> None:
        """RMSNorm, SwiGLU and RoPE as compiled fused kernels (on) or eager (off); same maths, same weights."""
        for module in self.modules():
            if isinstance(module, (DFlashRMSNorm, DFlashMLP, DFlashAttention)):
                module.fused = on

    # the target's embedding and LM head --------------------------------------------------------
    def attach_target(self, target_model) -> DFlashDraftModel:
        """Borrow the target's input embedding and LM head (frozen, not part of state_dict)."""
        self._target_embed = target_model.get_input_embeddings().weight.detach()
        self._target_lm_head = target_model.get_output_embeddings().weight.detach()
        return self

    def attach_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor) -> DFlashDraftModel:
        self._target_embed, self._target_lm_head = embed.detach(), lm_head.detach()
        return self

    def learn_mask_embedding(self, init: torch.Tensor) -> nn.Parameter:
        """Give the MASK slots an input of the drafter's own, trained with it and served by vLLM from
        mask_embedding.pt; `init` [H_target] is where it starts (the target's row of mask_token_id)."""
        if init.numel() != self.config.target_hidden_size:
            raise ValueError(f"a mask embedding needs {self.config.target_hidden_size} values (the target's hidden "
                             f"size), got {init.numel()}")
        self.mask_embedding = nn.Parameter(init.detach().reshape(-1).to(self.fc.weight.device, self.fc.weight.dtype,
                                                                         copy=True))
        return self.mask_embedding

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self._target_embed is None:
            raise RuntimeError("call attach_target(target_model) before running the drafter")
        w = self._target_embed
        out = F.embedding(token_ids.to(w.device), w).to(self.fc.weight.dtype)
        if self.mask_embedding is None:
            return out
        is_mask = (token_ids == self.config.mask_token_id).to(out.device).unsqueeze(-1)
        return torch.where(is_mask, self.mask_embedding.to(out.device, out.dtype), out)

    def block_ids(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """[..., ] last verified tokens -> [..., B] block ids [x, MASK, ..., MASK]."""
        b = self.config.block_size
        ids = torch.full((*first_tokens.shape, b), self.config.mask_token_id, dtype=torch.long,
                         device=first_tokens.device)
        ids[..., 0] = first_tokens
        return ids

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Post-norm hidden -> logits over the draft vocab (target vocab unless reduced)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self._target_lm_head is None:
            raise RuntimeError("call attach_target(target_model) before computing logits")
        return hidden @ self._target_lm_head.to(hidden.dtype).t()

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab token ids -> target ids (identity for full-vocab drafts)."""
        if self.lm_head is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids, -100 where the id is outside the reduced vocab."""
        if self.lm_head is None:
            return target_ids
        index = torch.cumsum(self.t2d.long(), 0) - 1
        safe = target_ids.clamp(min=0)
        return torch.where((target_ids >= 0) & self.t2d[safe], index[safe], torch.full_like(target_ids, -100))

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated aux target features [..., n*H_t] -> context states [..., H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    # inference ------------------------------------------------------------------------------
    def new_cache(self) -> DFlashCache:
        return DFlashCache(len(self.layers))

    @torch.no_grad()
    def append_context(self, cache: DFlashCache, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Add target features [b, n, n_aux*H_t] at absolute positions [b, n] to the cache."""
        ctx = self.project_context(features)
        cos, sin = self.rotary_emb(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            cache.append(i, k, v)
        cache.positions = positions if cache.positions is None else torch.cat([cache.positions, positions], -1)

    def forward_block(self, block_embeds: torch.Tensor, start_positions: torch.Tensor,
                      cache: DFlashCache) -> torch.Tensor:
        """One block per sequence: block_embeds [b, B, H] at positions start..start+B-1.

        Attends to every context position in `cache` (the caller keeps it to positions < start).
        Returns post-norm hidden states [b, B, H]; `logits()` turns them into logits.
        """
        b_len = block_embeds.shape[1]
        positions = start_positions[:, None] + torch.arange(b_len, device=block_embeds.device)
        cos, sin = self.rotary_emb(positions, block_embeds.dtype)
        h = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer.forward_block(h, cos, sin, cache.keys[i], cache.values[i], cache.positions, positions)
        return self.norm(h)

    @torch.no_grad()
    def propose(self, first_tokens: torch.Tensor, start_positions: torch.Tensor, cache: DFlashCache):
        """Greedy proposal: [b] last verified tokens -> [b, B-1] drafted target ids and logits."""
        hidden = self.forward_block(self.embed(self.block_ids(first_tokens)), start_positions, cache)
        logits = self.logits(hidden[:, 1:])
        return self.draft_to_target(logits.argmax(-1)), logits

    # training -------------------------------------------------------------------------------
    def forward_train(self, features: torch.Tensor, block_embeds: torch.Tensor, layout: TrainLayout,
                      attention: str = "split", anchor_slot: bool = True,
                      trained_slots: int | None = None) -> torch.Tensor:
        """Many blocks over one packed sequence.

        features [T, n_aux*H_t] context features of the packed sequence; block_embeds [N, B, H];
        layout: anchors, documents and positions. Returns post-norm hidden states [N, B, H], or
        [N, B - 1, H] without the anchor's slot (anchor_slot=False): slot 0 holds the given token, never
        a prediction, so the last layer needs its keys and values only; split attention then skips its
        query, attention row, output projection and MLP (a quarter of the last layer's block work at B=4).
        trained_slots D: the last layer's outputs stop at slot D ([N, D, H] without the anchor's slot,
        [N, D + 1, H] with it); every slot's keys and values are still read, as served
        (`objective.trained_slots`).
        """
        ctx = self.project_context(features)
        ctx_cos, ctx_sin = self.rotary_emb(layout.ctx_positions, ctx.dtype)
        cos, sin = self.rotary_emb(layout.block_positions, block_embeds.dtype)
        h = block_embeds
        checkpoint = self.activation_checkpointing and torch.is_grad_enabled()
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            first_query = 0 if anchor_slot or i < last else 1
            end_query = None if trained_slots is None or i < last else trained_slots + 1
            args = (layer, h, cos, sin, ctx, ctx_cos, ctx_sin, layout, attention, first_query, end_query)
            h = (torch.utils.checkpoint.checkpoint(_train_layer, *args, use_reentrant=False) if checkpoint
                 else _train_layer(*args))
        return self.norm(h)

    # initialisation -------------------------------------------------------------------------
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for module in self.modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
                    if module.bias is not None:
                        module.bias.zero_()
            elif isinstance(module, DFlashRMSNorm):
                nn.init.ones_(module.weight)
        # scale residual outputs like GPT-2 so deep drafts start near identity
        for layer in self.layers:
            for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                with torch.no_grad():
                    lin.weight.mul_(1.0 / math.sqrt(2 * len(self.layers)))


def _train_layer(layer, h, cos, sin, ctx, ctx_cos, ctx_sin, layout, attention, first_query=0, end_query=None):
    ctx_k, ctx_v = layer.self_attn.project_kv(ctx, ctx_cos, ctx_sin)
    return layer.forward_train(h, cos, sin, ctx_k, ctx_v, layout, attention, first_query, end_query)


def expected_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `cfg` must hold, with its shape (built on the meta device)."""
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
