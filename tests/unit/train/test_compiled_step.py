"""The training forward as one compiled graph (train/compiled_step.py): the eager step's loss, gradients and
statistics, one graph (or the few Inductor splits off) over micro-batches of changing sizes, and when it runs."""

import pytest
import torch
from test_batches import V, random_docs, tiny_model

from dflash_train.errors import ConfigError
from dflash_train.model.init import reduce_drafter_vocab
from dflash_train.model.row_buckets import rows
from dflash_train.train import compiled_step
from dflash_train.train.batches import build_microbatch, microbatch_loss
from dflash_train.train.recipe import load_recipe


def _reduced(base):
    """`base` with a 120-id draft vocabulary: about 60% of the labels fall outside it."""
    counts = torch.zeros(V, dtype=torch.long)
    counts[torch.randperm(V, generator=torch.Generator().manual_seed(4))[:120]] = 1
    model = reduce_drafter_vocab(base, counts, 120, base._target_lm_head)
    model.attach_target_weights(base._target_embed, base._target_lm_head)
    return model


def _with_topk(docs, k=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    for d in docs:
        d.target_topk_ids = torch.randint(0, V - 1, (len(d), k), generator=g).int()
        d.target_topk_logp = torch.log_softmax(torch.randn(len(d), k, generator=g) * 2, -1).sort(-1, True)[0]
    return docs


def _batch(lengths, seed=0, anchors=6, block_size=4):
    docs = _with_topk(random_docs(lengths, seed=seed), seed=seed + 3)
    return build_microbatch(docs, list(range(len(docs))), block_size=block_size, anchors_per_document=anchors,
                            labels="greedy", seed=seed, epoch=0)


def _step(model, fn):
    model.zero_grad()
    loss, stats = fn()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, stats


def _assert_same_step(a, b, rtol):
    assert b[0] == pytest.approx(a[0], rel=rtol)
    assert a[1].keys() == b[1].keys() and a[1]
    for name, g in a[1].items():
        torch.testing.assert_close(b[1][name], g, rtol=rtol, atol=rtol * max(1e-6, float(g.abs().max())),
                                   msg=lambda m, name=name: f"{name}: {m}")
    for field in ("correct", "valid", "accept_weighted", "block_weight", "weight_sum"):
        torch.testing.assert_close(getattr(b[2], field), getattr(a[2], field), msg=field)
    torch.testing.assert_close(b[2].loss_sum, a[2].loss_sum, rtol=rtol, atol=0)


@pytest.mark.parametrize("loss,prefix,reduced", [("ce", False, False), ("ce", True, True), ("kl", True, False),
                                                 ("kl", False, True)])
def test_the_padded_forward_is_the_eager_steps(loss, prefix, reduced):
    """Laid out per predicted slot and padded (blocks to a row bucket, weight 0; tokens to a row bucket, never
    attended; the grid's runs 4 blocks long), the forward gives the eager step's loss, every gradient and
    the same statistics (argmax, acceptance), in fp32: ce and kl, with and without prefix weighting, with a
    reduced vocabulary (labels outside it weigh nothing and stop the prefix)."""
    model = _reduced(tiny_model(layers=2)) if reduced else tiny_model(layers=2)
    mb = _batch([40, 31, 52, 9], anchors=5)
    assert rows(mb.anchors.numel()) > mb.anchors.numel()  # padded blocks are part of this check
    # a run holds 4 blocks here: documents of 5 blocks take two runs of the grid
    mb.layout.chunk_blocks = 4
    eager = _step(model, lambda: microbatch_loss(model, mb, loss=loss, chunk=16, prefix_weighting=prefix))
    padded = _step(model, lambda: compiled_step.microbatch_loss(model, mb, loss=loss, prefix_weighting=prefix,
                                                                compile=False))
    # fp32 rounding: the padded matmuls sum in another order (MKL's blocking for the padded shape, and the
    # buffers' alignment): fc's weight gradient, a sum over the tokens, moved by up to ~4e-5 of its largest
    # element in 1 of ~20 runs
    _assert_same_step(eager, padded, rtol=1e-4)
    assert mb.layout.grid is None  # the micro-batch's own layout is left as it was


@pytest.mark.parametrize("loss,prefix", [("ce", True), ("kl", False)])
def test_trained_slots_train_those_slots_alone_eager_and_padded(loss, prefix):
    """objective.trained_slots D at B=8: the blocks' slots past D carry no label, the loss, gradients and statistics
    are the full forward's over the same labels (slots past D unlabelled), and the padded forward (the compiled
    path's maths) gives the eager step's."""
    model = tiny_model(block_size=8, layers=2)
    docs = _with_topk(random_docs([40, 31, 52, 9], seed=5), seed=8)
    kw = {"block_size": 8, "anchors_per_document": 5, "labels": "greedy", "seed": 5, "epoch": 0}
    cut = build_microbatch(docs, list(range(len(docs))), trained_slots=3, **kw)
    assert cut.valid[:, 4:].sum() == 0 and cut.valid[:, 1:4].sum() > 0 and cut.labels.shape[1] == 8
    eager = _step(model, lambda: microbatch_loss(model, cut, loss=loss, chunk=16, prefix_weighting=prefix))
    padded = _step(model, lambda: compiled_step.microbatch_loss(model, cut, loss=loss, prefix_weighting=prefix,
                                                                compile=False))
    _assert_same_step(eager, padded, rtol=1e-4)
    if loss == "ce":  # the full forward, its labels past slot 3 dropped: the same step
        full = build_microbatch(docs, list(range(len(docs))), **kw)
        full.labels[:, 4:] = cut.labels[:, 4:]
        full.weights[:, 4:] = 0
        full.valid[:, 4:] = False
        _assert_same_step(eager, _step(model, lambda: microbatch_loss(model, full, loss=loss, chunk=16,
                                                                      prefix_weighting=prefix)), rtol=1e-4)


def test_padding_blocks_and_tokens_changes_nothing_the_real_blocks_see():
    """The padded layout: the added blocks are anchored at 0 (no context before them) and sit in runs of their
    own; the added tokens are never attended; every real block sees the context it saw before."""
    mb = _batch([40, 31, 52], anchors=7)
    n, t = mb.anchors.numel(), mb.layout.ctx_positions.numel()
    features = torch.randn(t, 8)
    padded, feats = compiled_step.padded_layout(mb.layout, features, n + 5, None)
    assert feats.shape == (rows(t), 8) and torch.equal(feats[:t], features) and not feats[t:].any()
    grid = padded.grid
    assert grid.per_run == mb.layout.chunk_blocks and grid.runs % 4 == 0 and grid.runs >= compiled_step.MIN_RUNS
    assert grid.ctx_ok.shape[0] == n + 5 and not grid.ctx_ok[n:].any()  # added blocks: no context at all
    # each real block's visible context, by packed position, is the unpadded layout's
    seen = torch.zeros(n, t, dtype=torch.bool)
    run_of = grid.rows // grid.per_run
    for i in range(n):
        cols = grid.ctx_index[run_of[i]][grid.ctx_ok[i, 0, 0]]
        seen[i, cols] = True
    torch.testing.assert_close(seen, mb.layout.context_allowed(None)[:, 0, 0])
    assert len(set(grid.rows.tolist())) == n + 5  # every block its own row of the grid


def test_one_graph_serves_micro_batches_of_changing_sizes_and_computes_the_eager_step():
    """Compiled (Inductor, bf16 autocast as the CPU demo runs it): micro-batches of other documents, block counts
    and token counts reuse one graph, also where the blocks fall on either side of the sizes at which Inductor's C++
    sums specialise (257, 342 and 513 blocks for this drafter: the micro-batch of 240 is padded up across the first
    two, the one of 520 runs eager), and each step's loss and gradients are the eager step's to bf16 rounding."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(layers=1)
    assert compiled_step.block_thresholds(model, 4, 3)[:3] == [257, 342, 513]
    batches = [_batch(lengths, seed=i, anchors=a) for i, (lengths, a) in
               enumerate([([30] * 50, 8), ([30] * 30, 8), ([33, 28, 30, 41, 48] * 9, 8), ([30] * 65, 8)])]
    assert [mb.anchors.numel() for mb in batches] == [400, 240, 360, 520]
    assert len({mb.packed.input_ids.numel() for mb in batches}) == 4
    assert all(mb.packed.input_ids.numel() <= 2048 for mb in batches)  # a sum over tokens x 2 kv heads stays below
    for mb in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager = _step(model, lambda b=mb: microbatch_loss(model, b, loss="kl", chunk=64, prefix_weighting=True))
            graph = _step(model, lambda b=mb: compiled_step.microbatch_loss(model, b, loss="kl", prefix_weighting=True))
        _assert_same_step(eager, graph, rtol=3e-2)
    assert counters["stats"]["unique_graphs"] == 1
    from dflash_train import compiled

    assert "training forward" not in compiled.fallbacks


def test_micro_batches_off_the_first_graphs_side_are_padded_or_run_eager_while_they_stay_rare():
    """`GraphSides`: the first micro-batch's side compiles; one below a threshold the first lies above is padded up
    across the highest such threshold (its side, never past the first's blocks), one above runs eager; once more
    than a tenth of the micro-batches (and 2) fell off its side, the next one compiles a graph for its side."""
    sides = compiled_step.GraphSides([152, 342])
    assert sides.blocks(224) == (224, True)  # the first: compiled
    assert sides.blocks(250) == (256, True)  # the same side
    assert sides.blocks(130) == (rows(152), True) == (160, True)  # the demo's case: padded across 152
    assert sides.blocks(20) == (160, True)  # an epoch's last, small micro-batch: no graph of its own either
    assert sides.blocks(350) == (rows(350), False)  # above 342, which the first lies below: eager
    assert sides.off == 3 and sides.seen == 5
    assert sides.blocks(130) == (144, True)  # a fourth off its side in 6: common, its graph compiles
    assert sides.blocks(140) == (144, True)  # and serves it from then on
    across = compiled_step.GraphSides([152, 200])
    across.blocks(400)
    assert across.blocks(130) == (rows(200), True) == (208, True)  # across both, to the highest
    model = tiny_model(layers=1)  # 4 heads, 2 kv heads; B = 4, 3 predicted slots
    assert compiled_step.block_thresholds(model, 4, 3) == sorted({4096 // m + 1 for m in (4, 16, 8, 3, 12, 6)})


def _recipe(**objective):
    return load_recipe(None, base={"data": {"prepared": "rows"}, "objective": {"attention": "split", **objective}}).recipe


def test_auto_compiles_long_bf16_mixed_runs_on_amx_cores_that_it_can_take():
    """auto: compiled where it was measured faster (bf16-mixed on AMX cores, long runs), eager elsewhere."""
    from dflash_train.machine import cpu_amx

    model = tiny_model(layers=1)
    r = _recipe(prefix_weighting=True)
    r.engine.precision = "bf16-mixed"  # what `auto` resolves to on cores with bf16 instructions

    def pick(recipe=r, choice="auto", steps=compiled_step.AUTO_MIN_STEPS, device="cpu", amx=True, attention="split"):
        return compiled_step.resolve(choice, model, recipe, attention=attention, device=device, total_steps=steps,
                                     amx=amx)

    assert pick() == "compiled"
    assert pick(steps=compiled_step.AUTO_MIN_STEPS - 1) == "eager"  # the compiles would not pay back
    assert pick(amx=False) == "eager"  # AVX512-BF16 without AMX: unmeasured
    assert pick(device="cuda", attention="flex") == "eager"
    fp32 = _recipe(prefix_weighting=True)
    fp32.engine.precision = "fp32"
    assert pick(fp32) == "eager"  # no faster on AVX2 cores
    assert pick(_recipe(prefix_weighting="expected_length")) == "eager"
    assert pick(choice="eager") == "eager" and pick(choice="compiled", steps=3, amx=False) == "compiled"
    assert cpu_amx(["avx512_bf16", "amx_bf16", "amx_tile"], "") and not cpu_amx(["avx512_bf16"], "")
    assert not cpu_amx(["avx512_bf16", "amx_bf16", "amx_tile"], "AVX512_CORE_BF16")
    assert cpu_amx(["avx512_bf16", "amx_bf16", "amx_tile"], "AVX512_CORE_AMX")
    assert cpu_amx(["avx512_bf16", "amx_bf16", "amx_tile"], "all")


@pytest.mark.parametrize("objective,attention,match", [({"prefix_weighting": "expected_length"}, "split",
                                                         "prefix_weighting is expected_length"),
                                                        ({}, "dense", "attention is dense")])
def test_compiled_where_it_cannot_run_is_refused_by_name(objective, attention, match):
    model = tiny_model(layers=1)
    with pytest.raises(ConfigError, match=f"objective.training_forward: compiled cannot run.*{match}.*eager"):
        compiled_step.resolve("compiled", model, _recipe(**objective), attention=attention, device="cpu",
                              total_steps=10)
