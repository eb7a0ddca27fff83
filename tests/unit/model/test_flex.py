"""Flex attention for training: the tile-level block mask equals torch's reference block mask, the
compiled kernel equals the dense reference (forward on CPU; forward and gradients on CUDA), micro-batches
of different lengths share one compiled kernel per bucket, and flex never runs eagerly."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask

from dflash_train.model.flex import TILE, _flex_call, bucket, compiled_flex, query_bucket, training_block_mask
from dflash_train.model.modeling_dflash import DFlashDraftModel
from dflash_train.model.train_layout import dense_training_mask, train_layout


def _layout(lengths, anchors, block_size, device="cpu"):
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    doc_start = torch.cat([torch.full((n,), int(s)) for s, n in zip(starts, lengths, strict=True)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    anchors = torch.as_tensor(anchors)
    return train_layout(anchors.to(device), doc_start[anchors].to(device), positions.to(device), block_size)


def _random_layout(gen, block_size):
    lengths = torch.randint(40, 700, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen).tolist()
    t = sum(lengths)
    k = int(torch.randint(1, min(t, 160), (1,), generator=gen))
    return _layout(lengths, torch.sort(torch.randperm(t, generator=gen)[:k]).values, block_size)


def _full_tiles(mask):
    """[Q tiles, KV tiles] bool: the tiles the mask marks full (read from its ordered indices; torch's own
    private converter changed its signature between 2.11 and 2.13)."""
    count, cols = mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0].long()
    dense = torch.zeros(cols.shape[0], -(-mask.seq_lengths[1] // TILE), dtype=torch.bool)
    used = torch.arange(cols.shape[1])[None, :] < count[:, None]
    rows = torch.arange(cols.shape[0])[:, None].expand_as(cols)
    dense[rows[used], cols[used]] = True
    return dense


def test_bucket_sizes_are_tile_multiples_and_at_most_a_third_padding():
    assert [bucket(n) for n in (1, 128, 129, 257, 385, 700, 1025, 3000, 4096, 5000)] == \
        [128, 128, 256, 384, 512, 768, 1536, 3072, 4096, 6144]
    for n in range(1, 20000, 37):
        b = bucket(n)
        assert b % TILE == 0 and b >= n and b - n < b / 3 + TILE
    assert len({bucket(n) for n in range(1, 65537)}) == 18  # 128 .. 65536: two sizes per octave


@pytest.mark.parametrize("window", [None, 48])
def test_block_mask_equals_torch_reference_and_mask_mod_is_the_training_mask(window):
    gen = torch.Generator().manual_seed(0)
    full_seen = 0
    for trial in range(12):
        layout = _random_layout(gen, [4, 8, 10, 16][trial % 4])
        mask = training_block_mask(layout.anchors, layout.doc_start, layout.ctx_positions, layout.block_positions,
                                   window)
        q_len, kv_len = mask.seq_lengths
        n, b = layout.block_positions.shape
        t, t_pad = layout.ctx_positions.numel(), kv_len - q_len
        assert (q_len, t_pad) == (query_bucket(n * b), bucket(t))
        ref = create_block_mask(mask.mask_mod, None, None, q_len, kv_len, device="cpu")  # evaluates every pair
        mine_any, ref_any = mask.to_dense()[0, 0].bool(), ref.to_dense()[0, 0].bool()
        mine_full, ref_full = _full_tiles(mask), _full_tiles(ref)
        assert not (mine_full & ~ref_full).any(), "a tile marked full holds a masked pair"
        if window is None:  # exact: every tile with a visible pair, no other
            assert torch.equal(mine_any, ref_any) and torch.equal(mine_full, ref_full)
        else:  # the window cuts inside tiles: a superset, masked exactly by mask_mod
            assert not (ref_any & ~mine_any).any()
        full_seen += int(ref_full.sum())
        # mask_mod on real rows and keys is the dense training mask; padding sees and is seen by nothing
        allowed = mask.mask_mod(0, 0, torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :])
        real = torch.cat([allowed[: n * b, :t], allowed[: n * b, t_pad: t_pad + n * b]], dim=1)
        assert torch.equal(real, dense_training_mask(layout, window))
        assert not allowed[n * b:].any() and not allowed[:, t:t_pad].any() and not allowed[:, t_pad + n * b:].any()
    if window is None:
        assert full_seen > 0  # the cases exercised full tiles


def test_block_mask_is_built_without_reading_the_device():
    """On the meta device any value read (item, nonzero, a data-dependent shape) raises."""
    layout = _layout([300, 200], [3, 40, 250, 301, 420], 16, device="meta")
    mask = training_block_mask(layout.anchors, layout.doc_start, layout.ctx_positions, layout.block_positions, None)
    assert mask.kv_num_blocks.device.type == "meta" and mask.seq_lengths == (128, 512 + 128)
    with pytest.raises(RuntimeError):
        mask.kv_num_blocks.sum().item()  # the negative control: a host read is caught here


def _model(cfg, seed=0):
    model = DFlashDraftModel(cfg)
    model.init_weights(std=0.2, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    model.attach_target_weights(torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=gen),
                                torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.1)
    return model


def _inputs(model, lengths, anchors, seed=0):
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    feats = torch.randn(t, cfg.num_aux_layers * cfg.target_hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size - 1, (t,), generator=gen)
    layout = _layout(lengths, anchors, cfg.block_size)
    return feats, model.embed(model.block_ids(ids[layout.anchors])), layout


@pytest.mark.slow  # ~20 s: Inductor compiles each bucket
def test_compiled_flex_forward_equals_dense_and_compiles_once_per_bucket(tiny_config):
    """The real compiled kernel (inductor, CPU; torch has no CPU flex backward, so forward only):
    three micro-batches of different lengths in one bucket compile once; a longer one once more."""
    cfg = tiny_config.model_copy(update={"layer_types": ["sliding_attention", "full_attention"],
                                         "sliding_window": 20})  # GQA (4 q heads, 2 kv), a window layer
    model = _model(cfg)
    torch._dynamo.reset()
    base = counters["stats"]["unique_graphs"]
    cases = [([50, 30], [2, 20, 51, 70]), ([90], [5, 6, 40, 80]), ([20, 20, 30], [1, 10, 21, 45, 60, 61]),
             ([200, 100], [3, 150, 199, 201, 260])]  # the last: context bucket 384, a new shape
    compiled = []
    for lengths, anchors in cases:
        feats, blocks, layout = _inputs(model, lengths, anchors)
        with torch.no_grad():
            flex = model.forward_train(feats, blocks, layout, attention="flex")
            dense = model.forward_train(feats, blocks, layout, attention="dense")
        torch.testing.assert_close(flex, dense, rtol=0, atol=2e-5)
        compiled.append(counters["stats"]["unique_graphs"] - base)
    # one kernel per (bucket, layer kind): the sliding-window and the full layer have their own mask
    assert compiled == [2, 2, 2, 4]


@pytest.mark.parametrize("autocast", [False, True])
def test_flex_gets_q_k_v_in_one_dtype_under_bf16_mixed(tiny_config, monkeypatch, autocast):
    """`engine.precision: bf16-mixed`: fp32 weights, the forward under autocast. q and k leave RMSNorm
    and RoPE in fp32 while v leaves its linear layer in bf16, a mix the flex kernel refuses; the call
    gets all three in bf16. Without autocast all stay fp32. (The compiled kernel is replaced by a
    recorder: torch has no CPU flex backward, and the dtype choice is made before the call.)"""
    import dflash_train.model.flex as flex

    seen = []

    def kernel(q, k, v, block_mask, scale):
        seen.append((q.dtype, k.dtype, v.dtype))
        return torch.zeros_like(q)

    monkeypatch.setattr(flex, "compiled_flex", lambda: kernel)
    model = _model(tiny_config)
    feats, blocks, layout = _inputs(model, [50, 30], [2, 20, 51, 70])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        attn = model.layers[0].self_attn
        h = blocks.requires_grad_()
        cos, sin = model.rotary_emb(layout.block_positions, h.dtype)
        q, (_, v) = attn.project_queries(h, cos, sin), attn.project_kv(h, cos, sin)
        out = model.forward_train(feats, h, layout, attention="flex")
    want = torch.bfloat16 if autocast else torch.float32
    if autocast:
        assert (q.dtype, v.dtype) == (torch.float32, torch.bfloat16)  # the mix flex would refuse
    assert seen == [(want, want, want)] * tiny_config.num_hidden_layers
    out.float().sum().backward()  # the casts are differentiable: gradients reach the fp32 weights
    assert model.layers[0].self_attn.o_proj.weight.grad.dtype == torch.float32


def test_flex_never_runs_eagerly():
    q = torch.randn(1, 2, 128, 8)
    layout = _layout([100], [3, 50], 4)
    mask = training_block_mask(layout.anchors, layout.doc_start, layout.ctx_positions, layout.block_positions, None)
    with pytest.raises(RuntimeError, match="eager"):
        _flex_call(q, torch.randn(1, 2, 256, 8), torch.randn(1, 2, 256, 8), mask, 0.3)
    with torch.compiler.set_stance("force_eager"), pytest.raises(RuntimeError, match="eager"):
        compiled_flex()(q, torch.randn(1, 2, 256, 8), torch.randn(1, 2, 256, 8), mask, 0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_flex_forward_and_grads_equal_dense_on_gpu(tiny_config, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cfg = tiny_config.model_copy(update={"layer_types": ["sliding_attention", "full_attention"],
                                         "sliding_window": 20})
    torch._dynamo.reset()
    base = counters["stats"]["unique_graphs"]
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    for lengths, anchors in [([50, 30], [2, 20, 51, 70]), ([90], [5, 6, 40, 80, 81, 82])]:
        results = {}
        for attention in ("flex", "dense"):
            model = _model(cfg).to("cuda", dtype)
            model.attach_target_weights(model._target_embed.to("cuda", dtype), model._target_lm_head.to("cuda", dtype))
            feats, blocks, layout = _inputs(model, lengths, anchors)
            layout = layout.to(torch.device("cuda"))
            f = feats.to("cuda", dtype).requires_grad_(True)
            out = model.forward_train(f, blocks.to("cuda"), layout, attention=attention)
            (out.float() * torch.linspace(-1, 1, out.shape[-1], device="cuda")).mean().backward()
            results[attention] = (out.float(), f.grad.float(), {k: p.grad.float() for k, p in model.named_parameters()})
        (of, gf, pf), (od, gd, pd) = results["flex"], results["dense"]
        torch.testing.assert_close(of, od, rtol=tol, atol=tol)
        torch.testing.assert_close(gf, gd, rtol=tol, atol=tol)
        for name in pd:
            torch.testing.assert_close(pf[name], pd[name], rtol=tol, atol=tol, msg=name)
    # both micro-batches share one bucket: one kernel per layer kind (window, full), forward and backward
    assert counters["stats"]["unique_graphs"] - base == 2


def test_query_lengths_pad_to_powers_of_two_tiles_and_the_context_to_the_run_budget():
    assert [query_bucket(n) for n in (1, 128, 129, 256, 257, 5000, 8192, 8193)] == \
        [128, 128, 256, 256, 512, 8192, 8192, 16384]
    # the query rows of a run's micro-batches (here 4K..128K) fall in at most 6 sizes, half the 1.5x ladder's
    sizes = range(4096, 131073, 512)
    assert len({query_bucket(n) for n in sizes}) == 6 and len({bucket(n) for n in sizes}) == 11
    layout = _layout([100, 60], [3, 50, 120], 4)
    mask = training_block_mask(layout.anchors, layout.doc_start, layout.ctx_positions, layout.block_positions,
                               None, ctx_len=1000)
    assert mask.seq_lengths == (128, bucket(1000) + 128)  # 160 context tokens, padded to the budget's bucket


@pytest.mark.gpu
def test_compiled_flex_under_bf16_mixed_autocast_equals_dense_on_gpu(tiny_config):
    """`engine.precision: bf16-mixed` on a GPU: fp32 weights, the forward under autocast, through the real
    compiled kernel (q/k/v cast to bf16 before it), forward and backward, to bf16 tolerance of dense."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    results = {}
    for attention in ("flex", "dense"):
        model = _model(tiny_config).to("cuda")
        model.attach_target_weights(model._target_embed.cuda(), model._target_lm_head.cuda())
        feats, blocks, layout = _inputs(model, [50, 30], [2, 20, 51, 70])
        layout = layout.to(torch.device("cuda"))
        f = feats.cuda().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.forward_train(f, blocks.cuda(), layout, attention=attention)
        (out.float() * torch.linspace(-1, 1, out.shape[-1], device="cuda")).mean().backward()
        results[attention] = (out.float(), f.grad.float(), model.fc.weight.grad.float())
    for a, b in zip(results["flex"], results["dense"], strict=True):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
