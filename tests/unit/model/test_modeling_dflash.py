"""The drafter's two entry points agree, and the attention paths match the dense reference."""

import pytest
import torch

from dflash_train.model.modeling_dflash import DFlashDraftModel
from dflash_train.model.train_layout import dense_training_mask, train_layout


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg)
    model.init_weights(std=0.2, seed=seed)  # large weights so every term matters
    gen = torch.Generator().manual_seed(seed + 1)
    model.attach_target_weights(torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=gen),
                                torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.1)
    return model


def _packed(cfg, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    feats = torch.randn(total, cfg.num_aux_layers * cfg.target_hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size - 1, (total,), generator=gen)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    doc_start = torch.cat([torch.full((n,), int(s)) for s, n in zip(starts, lengths, strict=False)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    return feats, ids, doc_start, positions


def _inference_hidden(model, feats, ids, doc_start, positions, anchor):
    """Run the inference entry point for the block at `anchor`, growing and cropping the cache."""
    start = int(doc_start[anchor])
    p = int(positions[anchor])
    cache = model.new_cache()
    if p > 0:
        # feed the context in two pieces, overshoot by two positions, then crop back:
        # exactly what the decode loop does after a rejection
        cut = max(1, p // 2)
        extra = min(2, len(feats) - start - p)
        model.append_context(cache, feats[None, start:start + cut], positions[None, start:start + cut])
        model.append_context(cache, feats[None, start + cut:start + p + extra],
                             positions[None, start + cut:start + p + extra])
        cache.crop(p)
        assert cache.length == p
    block = model.embed(model.block_ids(ids[anchor:anchor + 1]))
    return model.forward_block(block, positions[anchor:anchor + 1], cache)[0]


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_inference_equals_training_at_start_middle_end(tiny_config, block_size):
    cfg = tiny_config.model_copy(update={"block_size": block_size})
    model = _model(cfg)
    lengths = [37, 50]
    feats, ids, doc_start, positions = _packed(cfg, lengths)
    # anchors at the start, middle and end of both documents (the second starts at 37)
    anchors = torch.tensor([0, 1, 18, 36 - block_size + 1, 37, 38 + 20, 37 + 50 - 2])
    layout = train_layout(anchors, doc_start[anchors], positions, block_size)
    blocks = model.embed(model.block_ids(ids[anchors]))
    with torch.no_grad():
        train_hidden = model.forward_train(feats, blocks, layout, attention="split")
        train_logits = model.logits(train_hidden)
        for n, a in enumerate(anchors.tolist()):
            inf_logits = model.logits(_inference_hidden(model, feats, ids, doc_start, positions, a))
            torch.testing.assert_close(inf_logits, train_logits[n], rtol=0, atol=1e-5)


def test_context_is_blind_to_other_documents_and_later_positions(tiny_config):
    model = _model(tiny_config)
    feats, ids, doc_start, positions = _packed(tiny_config, [20, 30])
    anchors = torch.tensor([10, 35])
    layout = train_layout(anchors, doc_start[anchors], positions, tiny_config.block_size)
    blocks = model.embed(model.block_ids(ids[anchors]))
    with torch.no_grad():
        base = model.forward_train(feats, blocks, layout)
        changed = feats.clone()
        changed[10:20] += 5.0   # at/after anchor 10 in doc 0 (anchor 35 is in doc 1: blind to doc 0)
        changed[35:] += 5.0     # at/after anchor 35
        after = model.forward_train(changed, blocks, layout)
    torch.testing.assert_close(after, base, rtol=0, atol=1e-6)
    changed = feats.clone()
    changed[9] += 5.0  # the position just before anchor 10 is visible
    with torch.no_grad():
        assert (model.forward_train(changed, blocks, layout)[0] - base[0]).abs().max() > 1e-3


def test_blocks_are_bidirectional_inside_and_blind_to_each_other(tiny_config):
    model = _model(tiny_config)
    feats, ids, doc_start, positions = _packed(tiny_config, [60])
    anchors = torch.tensor([10, 30])
    layout = train_layout(anchors, doc_start[anchors], positions, tiny_config.block_size)
    blocks = model.embed(model.block_ids(ids[anchors]))
    with torch.no_grad():
        base = model.forward_train(feats, blocks, layout)
        changed = blocks.clone()
        changed[1, -1] += 3.0  # last slot of block 1
        after = model.forward_train(feats, changed, layout)
    assert (after[1, 0] - base[1, 0]).abs().max() > 1e-3  # slot 0 sees the last slot: non-causal
    torch.testing.assert_close(after[0], base[0], rtol=0, atol=1e-6)  # block 0 never sees block 1


@pytest.mark.parametrize("grid", [True, False])
@pytest.mark.parametrize("chunk_blocks", [32, 2, 1])
@pytest.mark.parametrize("sliding", [False, True])
def test_split_attention_equals_dense_reference_forward_and_backward(tiny_config, sliding, chunk_blocks, grid,
                                                                     monkeypatch):
    """Split attention, all runs in one padded grid (`grid`) or run by run (checkpointed), against the dense mask."""
    import dflash_train.model.modeling_dflash as modeling

    monkeypatch.setattr(modeling, "SPLIT_GRID_PADDING_PER_RUN", 10**9 if grid else 0)  # the grid whatever it pads
    if not grid:
        monkeypatch.setattr(modeling, "SPLIT_GRID_ELEMENTS", 0)
    update = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6} if sliding else {}
    cfg = tiny_config.model_copy(update=update)
    feats, ids, doc_start, positions = _packed(cfg, [25, 40])
    anchors = torch.tensor([1, 12, 26, 50, 63])
    results = {}
    for attention in ("split", "dense"):
        model = _model(cfg)
        layout = train_layout(anchors, doc_start[anchors], positions, cfg.block_size, chunk_blocks=chunk_blocks)
        f = feats.clone().requires_grad_(True)
        out = model.forward_train(f, model.embed(model.block_ids(ids[anchors])), layout, attention=attention)
        loss = (out * torch.linspace(-1, 1, out.shape[-1])).mean()  # a mean, like a real loss
        loss.backward()
        results[attention] = (out.detach(), f.grad, {n: p.grad for n, p in model.named_parameters()})
    out_s, fg_s, g_s = results["split"]
    out_d, fg_d, g_d = results["dense"]
    torch.testing.assert_close(out_s, out_d, rtol=0, atol=1e-5)
    torch.testing.assert_close(fg_s, fg_d, rtol=0, atol=1e-5)
    assert fg_s.abs().sum() > 0
    for name in g_s:
        torch.testing.assert_close(g_s[name], g_d[name], rtol=1e-5, atol=1e-5, msg=name)


def _assert_cut_forward_is_the_full_ones(cfg, attention, cut: dict, keep: slice, shape: tuple):
    """The training forward with `cut` (forward_train's keywords) against the full one's slots `keep`: the same
    outputs (of `shape`) and every gradient through them the same."""
    feats, ids, doc_start, positions = _packed(cfg, [25, 40])
    anchors = torch.tensor([1, 12, 26, 50, 63])
    results = []
    for kwargs in ({}, cut):
        model = _model(cfg)
        layout = train_layout(anchors, doc_start[anchors], positions, cfg.block_size, chunk_blocks=2)
        f = feats.clone().requires_grad_(True)
        out = model.forward_train(f, model.embed(model.block_ids(ids[anchors])), layout, attention=attention, **kwargs)
        out = out if kwargs else out[:, keep]
        assert out.shape == (len(anchors), *shape)
        (out * torch.linspace(-1, 1, out.shape[-1])).mean().backward()
        results.append((out.detach(), f.grad, {n: p.grad for n, p in model.named_parameters()}))
    (out_a, fg_a, g_a), (out_b, fg_b, g_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(fg_b, fg_a, rtol=0, atol=1e-5)
    for name in g_a:
        torch.testing.assert_close(g_b[name], g_a[name], rtol=1e-5, atol=1e-5, msg=name)
    assert g_b["layers.0.self_attn.k_proj.weight"].abs().sum() > 0  # the cut slots' keys still reach the loss


@pytest.mark.parametrize("attention", ["split", "dense"])
@pytest.mark.parametrize("layers,sliding", [(1, False), (2, False), (2, True)])
def test_without_the_anchor_slot_the_other_slots_and_gradients_are_unchanged(tiny_config, attention, layers, sliding):
    """anchor_slot=False drops slot 0's output (split attention: its query, output projection and MLP in the last
    layer): slots 1.. and every gradient through them stay what the full forward gives."""
    update = {"num_hidden_layers": layers}
    if sliding:  # the last layer slides: its in-block mask loses slot 0's row
        update |= {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 6}
    cfg = tiny_config.model_copy(update=update)
    _assert_cut_forward_is_the_full_ones(cfg, attention, {"anchor_slot": False}, slice(1, None),
                                         (cfg.block_size - 1, cfg.hidden_size))


@pytest.mark.parametrize("attention,grid", [("split", True), ("split", False), ("dense", False)])
@pytest.mark.parametrize("layers", [1, 2])
def test_trained_slots_cut_the_last_layer_to_those_slots_and_change_nothing_they_see(tiny_config, attention, grid,
                                                                                      layers, monkeypatch):
    """trained_slots=D: the last layer's outputs stop at slot D, and those outputs and every gradient through
    them are the full forward's (every slot's keys and values are still read, as served)."""
    import dflash_train.model.modeling_dflash as modeling

    monkeypatch.setattr(modeling, "SPLIT_GRID_PADDING_PER_RUN", 10**9 if grid else 0)
    if not grid:
        monkeypatch.setattr(modeling, "SPLIT_GRID_ELEMENTS", 0)
    cfg = tiny_config.model_copy(update={"num_hidden_layers": layers})
    assert cfg.block_size - 1 > 3
    _assert_cut_forward_is_the_full_ones(cfg, attention, {"anchor_slot": False, "trained_slots": 3}, slice(1, 4),
                                         (3, cfg.hidden_size))


def test_flex_attention_forward_equals_dense_with_and_without_the_anchor_slot_and_the_deep_slots(tiny_config):
    model = _model(tiny_config)
    feats, ids, doc_start, positions = _packed(tiny_config, [30, 34])
    anchors = torch.tensor([3, 20, 31, 50])
    blocks = model.embed(model.block_ids(ids[anchors]))
    layout = train_layout(anchors, doc_start[anchors], positions, 8)
    with torch.no_grad():  # torch 2.13 has no flex-attention backward on CPU
        dense = model.forward_train(feats, blocks, layout, "dense")
        flex = model.forward_train(feats, blocks, train_layout(anchors, doc_start[anchors], positions, 8), "flex")
        rest = model.forward_train(feats, blocks, layout, "flex", anchor_slot=False)
        first = model.forward_train(feats, blocks, layout, "flex", anchor_slot=False, trained_slots=3)
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-5)
    torch.testing.assert_close(rest, dense[:, 1:], rtol=0, atol=1e-5)
    torch.testing.assert_close(first, dense[:, 1:4], rtol=0, atol=1e-5)


def test_split_attention_takes_the_grid_only_while_its_padding_pays(tiny_config, monkeypatch):
    """One document in two runs whose spans differ (10 and 50 tokens): the grid pads the first run's 2 blocks by 40
    tokens. It is taken while that padding is within `SPLIT_GRID_PADDING_PER_RUN` for the one run it saves, and
    run by run past it, with the same output either way."""
    import dflash_train.model.modeling_dflash as modeling

    cfg = tiny_config.model_copy(update={"num_hidden_layers": 1})
    model = _model(cfg)
    feats, ids, doc_start, positions = _packed(cfg, [60])
    anchors = torch.tensor([5, 10, 40, 50])
    layout = train_layout(anchors, doc_start[anchors], positions, cfg.block_size, chunk_blocks=2)
    g = layout.padded_runs(None)
    assert (g.runs, g.per_run, g.span, g.run_pairs) == (2, 2, 50, 2 * 10 + 2 * 50)
    padding = (g.runs * g.per_run * g.span - g.run_pairs) * cfg.num_attention_heads * cfg.block_size
    calls = []
    grid = modeling.DFlashAttention._attend_grid
    monkeypatch.setattr(modeling.DFlashAttention, "_attend_grid", lambda self, *a: calls.append(1) or grid(self, *a))
    outs, taken = [], []
    for allowance in (padding, padding - 1):
        monkeypatch.setattr(modeling, "SPLIT_GRID_PADDING_PER_RUN", allowance)
        calls.clear()
        with torch.no_grad():
            outs.append(model.forward_train(feats, model.embed(model.block_ids(ids[anchors])), layout))
        taken.append(bool(calls))
    assert taken == [True, False]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)


def test_split_runs_stay_inside_one_document_and_stop_at_their_last_anchor(tiny_config):
    _, _, doc_start, positions = _packed(tiny_config, [25, 40])
    anchors = torch.tensor([1, 12, 20, 26, 50, 63])
    layout = train_layout(anchors, doc_start[anchors], positions, 4, chunk_blocks=2)
    assert layout.segments() == [(0, 2, 0, 12), (2, 3, 0, 20), (3, 5, 25, 50), (5, 6, 25, 63)]
    # the same runs side by side: 4 runs of at most 2 blocks against at most 38 context tokens
    rows, ctx_index, ctx_ok, runs, per_run, span, run_pairs = layout.padded_runs(None)
    assert (runs, per_run, span) == (4, 2, 38)
    assert run_pairs == 2 * 12 + 1 * 20 + 2 * 25 + 1 * 38  # what the runs score one by one
    assert rows.tolist() == [0, 1, 2, 4, 5, 6]
    assert ctx_index[0].tolist() == list(range(38)) and ctx_index[3].tolist() == list(range(25, 63))
    # block 4 (anchor 50, run 3 from token 25) sees tokens 25..49 of its run; block 0 (anchor 1) only token 0
    assert ctx_ok[4, 0, 0].nonzero().squeeze(1).tolist() == list(range(25))
    assert ctx_ok[0, 0, 0].nonzero().squeeze(1).tolist() == [0]
    none = train_layout(anchors[:0], doc_start[:0], positions, 4)
    assert none.segments() == [] and none.padded_runs(None)[3:] == (0, 0, 0, 0)


def test_dense_mask_is_the_training_mask(tiny_config):
    _, _, doc_start, positions = _packed(tiny_config, [5, 6])
    anchors = torch.tensor([2, 7])
    layout = train_layout(anchors, doc_start[anchors], positions, 2)
    mask = dense_training_mask(layout, None).int()
    expected = torch.tensor([
        # ctx 0..10                          blocks (2 x 2)
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1],
        [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1],
    ])
    assert torch.equal(mask, expected)


def test_reduced_vocab_maps_draft_ids_to_target_ids(tiny_config):
    cfg = tiny_config.model_copy(update={"draft_vocab_size": 4})
    model = DFlashDraftModel(cfg)
    kept = torch.tensor([3, 7, 50, 99])
    model.d2t.copy_(kept - torch.arange(4))
    model.t2d.zero_()
    model.t2d[kept] = True
    assert torch.equal(model.draft_to_target(torch.arange(4)), kept)
    assert model.target_to_draft(torch.tensor([7, 8, 99, -100])).tolist() == [1, -100, 3, -100]
    assert model.logits(torch.randn(2, cfg.hidden_size)).shape == (2, 4)
    assert {"lm_head.weight", "d2t", "t2d"} <= set(model.state_dict())


def test_full_vocab_drafter_stores_no_embedding_or_head(tiny_config):
    names = set(DFlashDraftModel(tiny_config).state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.mlp.down_proj.weight", "layers.0.input_layernorm.weight"} <= names


def test_dropout_acts_in_training_mode_only_and_recomputes_the_same_masks_under_checkpointing(tiny_config):
    """objective.dropout: the residual branches are dropped in training mode only (eval mode, as every check,
    decode and engine reads the drafter, equals the drafter without dropout), each training forward draws new
    masks, and a layer recomputed in the backward (activation checkpointing) draws the forward's masks again."""
    model = _model(tiny_config)
    feats, ids, doc_start, positions = _packed(tiny_config, [37, 50])
    anchors = torch.tensor([0, 5, 18, 37, 60])
    layout = train_layout(anchors, doc_start[anchors], positions, tiny_config.block_size)
    blocks = model.embed(model.block_ids(ids[anchors]))

    def run(seed=0):
        torch.manual_seed(seed)
        return model.forward_train(feats, blocks, layout)

    model.eval()
    with torch.no_grad():
        whole = run()
        model.set_dropout(0.3)
        assert torch.equal(run(), whole)
        model.train()
        dropped, again, other = run(), run(), run(seed=1)
        model.set_dropout(0.0)
        assert torch.equal(run(), whole)
    assert torch.equal(dropped, again) and not torch.allclose(dropped, other)
    assert float((dropped - whole).abs().max()) > 1e-2

    model.set_dropout(0.3)
    grads = []
    for checkpointing in (False, True):
        model.activation_checkpointing = checkpointing
        model.zero_grad()
        run(seed=2).pow(2).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_mask_embedding_of_its_own_feeds_the_mask_slots_only_and_learns_from_them(tiny_config):
    """drafter.train_mask_embedding: the MASK slots take the drafter's vector (vLLM's mask_embedding.pt), the
    anchor slot keeps the target's row; started at the target's row it changes nothing; its gradient is the sum of
    the mask slots' input gradients."""
    model = _model(tiny_config)
    feats, ids, doc_start, positions = _packed(tiny_config, [24])
    anchors = [5, 11]
    before = torch.stack([_inference_hidden(model, feats, ids, doc_start, positions, a) for a in anchors])
    assert model.mask_embedding is None and "mask_embedding" not in model.state_dict()
    model.learn_mask_embedding(model._target_embed[tiny_config.mask_token_id])
    same = torch.stack([_inference_hidden(model, feats, ids, doc_start, positions, a) for a in anchors])
    torch.testing.assert_close(same, before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="64 values"):
        model.learn_mask_embedding(torch.zeros(63))

    with torch.no_grad():
        model.mask_embedding.copy_(torch.randn(tiny_config.target_hidden_size))
    block = model.block_ids(ids[torch.tensor(anchors)])
    embeds = model.embed(block)
    torch.testing.assert_close(embeds[:, 0], model._target_embed[ids[torch.tensor(anchors)]], rtol=0, atol=0)
    torch.testing.assert_close(embeds[:, 1:], model.mask_embedding.detach().expand(2, tiny_config.block_size - 1, -1),
                               rtol=0, atol=0)
    moved = torch.stack([_inference_hidden(model, feats, ids, doc_start, positions, a) for a in anchors])
    assert (moved - before).abs().max() > 1e-2

    # the gradient: what reaches the mask slots' inputs, summed over them
    leaf = embeds.detach().requires_grad_(True)
    weights = torch.randn_like(leaf)
    (leaf * weights).sum().backward()
    (model.embed(block) * weights).sum().backward()
    torch.testing.assert_close(model.mask_embedding.grad, leaf.grad[:, 1:].sum((0, 1)), rtol=1e-6, atol=1e-6)
