"""Micro-batch layout and the attention paths: split and flex equal the dense reference."""

import pytest
import torch

from dflash_train.data.packing import Document
from dflash_train.model.config import DFlashConfig
from dflash_train.model.modeling_dflash import DFlashDraftModel
from dflash_train.model.train_layout import dense_training_mask
from dflash_train.train.anchors import IGNORE, anchor_candidates
from dflash_train.train.batches import build_microbatch, microbatch_loss, microbatch_predictions

V, H, NF = 300, 64, 2


def tiny_model(block_size=4, layers=2, seed=0):
    cfg = DFlashConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=V, draft_vocab_size=V, target_hidden_size=H,
                       num_target_layers=8, aux_hidden_state_layer_ids=[2, 5], block_size=block_size,
                       mask_token_id=V - 1, dtype="float32")
    model = DFlashDraftModel(cfg)
    model.init_weights(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    model.attach_target_weights(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.1)
    return model


def random_docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3:] = True  # assistant part
        docs.append(Document(input_ids=torch.randint(0, V - 1, (n,), generator=g), loss_mask=mask,
                             features=torch.randn(n, NF * H, generator=g),
                             greedy_next=torch.randint(0, V - 1, (n,), generator=g)))
    return docs


def test_layout_never_crosses_documents():
    docs = random_docs([20, 9, 31])
    mb = build_microbatch(docs, [0, 1, 2], block_size=4, anchors_per_document=5, labels="greedy", seed=0, epoch=0)
    packed = mb.packed
    # per-document budget: at most 5 anchors each, every document with candidates gets some
    doc_of = packed.doc_ids[mb.anchors]
    assert [int((doc_of == d).sum()) for d in range(3)] == [5, 5, 5]
    mask = dense_training_mask(mb.layout, None)
    t = packed.input_ids.numel()
    for n, a in enumerate(mb.anchors.tolist()):
        row = mask[n * 4]
        seen = torch.nonzero(row[:t]).flatten()
        if seen.numel():
            assert int(seen.min()) == int(packed.doc_start[a]) and int(seen.max()) == a - 1
        blk = torch.nonzero(row[t:]).flatten()
        assert blk.tolist() == list(range(n * 4, n * 4 + 4))
    # labels: slot 0 never, slot k = greedy_next[a+k-1], nothing past the document end
    for n, a in enumerate(mb.anchors.tolist()):
        assert mb.labels[n, 0] == IGNORE
        for k in range(1, 4):
            if a + k < int(packed.doc_end[a]):
                assert mb.labels[n, k] == packed.greedy_next[a + k - 1]
            else:
                assert mb.labels[n, k] == IGNORE


def test_dataset_labels_and_resampling():
    docs = random_docs([40])
    a = build_microbatch(docs, [7], block_size=4, anchors_per_document=6, labels="dataset", seed=0, epoch=0)
    b = build_microbatch(docs, [7], block_size=4, anchors_per_document=6, labels="dataset", seed=0, epoch=0)
    c = build_microbatch(docs, [7], block_size=4, anchors_per_document=6, labels="dataset", seed=0, epoch=1)
    assert torch.equal(a.anchors, b.anchors) and not torch.equal(a.anchors, c.anchors)
    n, k = 0, 2
    assert a.labels[n, k] == docs[0].input_ids[a.anchors[n] + k]


def test_explicit_anchors_get_the_labels_of_sampled_ones():
    docs = random_docs([40, 30])
    sampled = build_microbatch(docs, [3, 4], block_size=4, anchors_per_document=6, labels="greedy", seed=0, epoch=0)
    per_doc = [sampled.anchors[sampled.anchors < 40], sampled.anchors[sampled.anchors >= 40] - 40]
    given = build_microbatch(docs, [3, 4], block_size=4, anchors_per_document=0, labels="greedy", seed=9, epoch=5,
                             anchors=per_doc)
    assert torch.equal(given.anchors, sampled.anchors) and torch.equal(given.labels, sampled.labels)
    # a position outside the loss mask or at a document's end gets a block with no label
    edge = build_microbatch(docs[:1], [0], block_size=4, anchors_per_document=0, labels="greedy", seed=0, epoch=0,
                            anchors=[torch.tensor([2, 39])])
    assert (edge.labels == IGNORE).all()


def test_block_weight_is_candidates_over_sampled_blocks():
    docs = random_docs([40, 12])  # loss mask from n // 3: 26 and 7 anchor candidates
    mb = build_microbatch(docs, [0, 1], block_size=4, anchors_per_document=6, labels="greedy", seed=0, epoch=0)
    first = mb.anchors < 40
    assert int(first.sum()) == 6 and int((~first).sum()) == 6
    assert torch.allclose(mb.block_weight[first], torch.tensor(26 / 6)) and torch.allclose(
        mb.block_weight[~first], torch.tensor(7 / 6))
    assert float(mb.block_weight.sum()) == pytest.approx(26 + 7)  # the blocks stand for every candidate once
    # a density: ceil(0.25 * 26) = 7 capped at 5; ceil(0.25 * 7) = 2, at least 2
    dense = build_microbatch(docs, [0, 1], block_size=4, anchors_per_document=6, labels="greedy", seed=0, epoch=0,
                             anchor_density=(0.25, 2, 5))
    assert int((dense.anchors < 40).sum()) == 5 and int((dense.anchors >= 40).sum()) == 2
    assert float(dense.block_weight.sum()) == pytest.approx(26 + 7)


def test_sampling_every_candidate_gives_the_checks_acceptance():
    """A budget above every document's candidates samples them all: each block weighs 1 and the step's
    acceptance length is the check's (a block at every candidate position)."""
    model = tiny_model().eval()
    docs = random_docs([40, 12, 25], seed=3)
    every = [anchor_candidates(d.loss_mask) for d in docs]
    sampled = build_microbatch(docs, [0, 1, 2], block_size=4, anchors_per_document=100, labels="greedy", seed=0,
                               epoch=0)
    given = build_microbatch(docs, [0, 1, 2], block_size=4, anchors_per_document=0, labels="greedy", seed=0,
                             epoch=0, anchors=every)
    assert torch.equal(sampled.anchors, given.anchors) and torch.equal(sampled.block_weight, given.block_weight)
    assert torch.equal(sampled.block_weight, torch.ones(sampled.anchors.numel()))
    with torch.no_grad():
        a = microbatch_loss(model, sampled)[1].summary()
        b = microbatch_loss(model, given)[1].summary()
    assert a["accept_len"] == pytest.approx(b["accept_len"]) == pytest.approx(a["accept_len_per_block"])


def test_predictions_of_a_narrower_block_match_the_served_block():
    """Blocks as wide as the labels (eval's --block-size < the trained size) equal inference's block."""
    model = tiny_model(block_size=6, layers=1).eval()
    doc = random_docs([30])[0]
    a = 17
    mb = build_microbatch([doc], [0], block_size=4, anchors_per_document=0, labels="dataset", seed=0, epoch=0,
                          anchors=[torch.tensor([a])])
    with torch.no_grad():
        _, preds = microbatch_predictions(model, mb)
        cache = model.new_cache()
        model.append_context(cache, doc.features[None, :a], torch.arange(a)[None])
        block = torch.full((1, 4), model.config.mask_token_id)
        block[0, 0] = doc.input_ids[a]
        hidden = model.forward_block(model.embed(block), torch.tensor([a]), cache)  # a 4-wide served block
    assert torch.equal(preds, model.logits(hidden[0, 1:]).argmax(-1))


def _run(model, mb, attention, grad=True):
    model.zero_grad()
    loss, _ = microbatch_loss(model, mb, attention=attention, chunk=7)
    if grad:
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), None


@pytest.mark.parametrize("window", [None, 6])
def test_split_equals_dense_forward_and_grads(window):
    model = tiny_model()
    if window:
        model.config.layer_types = ["sliding_attention", "full_attention"]
        model.config.sliding_window = window
        model = DFlashDraftModel(model.config)
        model.init_weights(seed=0)
        g = torch.Generator().manual_seed(1)
        model.attach_target_weights(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.1)
    mb = build_microbatch(random_docs([25, 18, 30]), [0, 1, 2], block_size=4, anchors_per_document=8,
                          labels="greedy", seed=0, epoch=0)
    ld, gd = _run(model, mb, "dense")
    ls, gs = _run(model, mb, "split")
    assert torch.allclose(ls, ld, atol=1e-5, rtol=1e-5)
    for name in gd:
        assert torch.allclose(gs[name], gd[name], atol=1e-5, rtol=1e-4), name


def test_flex_forward_equals_dense():
    model = tiny_model()
    mb = build_microbatch(random_docs([25, 18]), [0, 1], block_size=4, anchors_per_document=8,
                          labels="greedy", seed=0, epoch=0)
    with torch.no_grad():
        ld, _ = _run(model, mb, "dense", grad=False)
        try:
            lf, _ = _run(model, mb, "flex", grad=False)
        except Exception as exc:  # flex attention unavailable in this CPU build
            pytest.skip(f"flex attention forward does not run on this CPU build: {exc}")
    assert torch.allclose(lf, ld, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_flex_grads_equal_dense_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = tiny_model().cuda()
    model.attach_target_weights(model._target_embed.cuda(), model._target_lm_head.cuda())
    mb = build_microbatch(random_docs([25, 18]), [0, 1], block_size=4, anchors_per_document=8,
                          labels="greedy", seed=0, epoch=0)
    ld, gd = _run(model, mb, "dense")
    lf, gf = _run(model, mb, "flex")
    assert torch.allclose(lf, ld, atol=1e-5, rtol=1e-5)
    for name in gd:
        assert torch.allclose(gf[name], gd[name], atol=1e-5, rtol=1e-4), name


def test_empty_microbatch_has_zero_loss_with_graph():
    model = tiny_model()
    doc = random_docs([10])[0]
    doc.loss_mask[:] = False
    mb = build_microbatch([doc], [0], block_size=4, anchors_per_document=8, labels="greedy", seed=0, epoch=0)
    loss, stats = microbatch_loss(model, mb)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(stats.blocks) == 0


def _saved_bytes(model, mb, attention):
    """Bytes autograd keeps for the backward of one micro-batch."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = microbatch_loss(model, mb, attention=attention, chunk=7)
    return loss, total[0]


@pytest.mark.parametrize("attention", ["split", "dense"])
def test_activation_checkpointing_gives_the_same_gradients_with_less_saved(attention):
    mb = build_microbatch(random_docs([40, 31, 52]), [0, 1, 2], block_size=4, anchors_per_document=12,
                          labels="greedy", seed=0, epoch=0)
    results = {}
    for checkpointing in (False, True):
        model = tiny_model(layers=3)
        model.activation_checkpointing = checkpointing
        loss, saved = _saved_bytes(model, mb, attention)
        loss.backward()
        results[checkpointing] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved)
    (l0, g0, s0), (l1, g1, s1) = results[False], results[True]
    assert torch.equal(l0, l1)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-6, msg=name)
    assert s1 < 0.6 * s0, (s1, s0)  # only the layer inputs stay


@pytest.mark.parametrize("attention", ["split", "dense"])
def test_bf16_microbatch_loss_equals_fp32_to_bf16_tolerance(attention):
    """bf16 weights (DeepSpeed's bf16) and fp32 weights under autocast (bf16-mixed) both land within
    bf16 rounding of fp32; bf16-mixed keeps fp32 gradients, and comes closer to fp32."""
    mb = build_microbatch(random_docs([40, 31]), [0, 1], block_size=4, anchors_per_document=12,
                          labels="greedy", seed=0, epoch=0)
    results = {}
    for mode in ("fp32", "bf16", "bf16-mixed"):
        model = tiny_model()
        if mode == "bf16":
            model = model.to(torch.bfloat16)
            model.attach_target_weights(model._target_embed.bfloat16(), model._target_lm_head.bfloat16())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16-mixed"):
            loss, stats = microbatch_loss(model, mb, attention=attention, chunk=16)
        loss.backward()
        assert model.fc.weight.grad.dtype == (torch.bfloat16 if mode == "bf16" else torch.float32)
        results[mode] = (float(loss.detach()), stats.summary()["positions"], model.fc.weight.grad.float())
    l32, n32, g32 = results["fp32"]
    errors = {}
    for mode in ("bf16", "bf16-mixed"):
        loss, n, g = results[mode]
        assert n == n32 > 0 and abs(loss - l32) <= 1e-2 * abs(l32), mode
        errors[mode] = float((g - g32).abs().max() / g32.abs().max())
        assert 0 < errors[mode] <= 5e-2, (mode, errors)
    assert errors["bf16-mixed"] < errors["bf16"], errors


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["split", "flex"])
def test_microbatch_forward_and_backward_never_sync_on_gpu(attention):
    """Under CUDA's sync debug mode every host-device synchronisation raises."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dflash_train.train.loss import BlockStats

    model = tiny_model().to("cuda", torch.bfloat16)
    model.attach_target_weights(model._target_embed.to("cuda", torch.bfloat16),
                                model._target_lm_head.to("cuda", torch.bfloat16))
    mbs = [build_microbatch(random_docs(lengths, seed=i), list(range(len(lengths))), block_size=4,
                            anchors_per_document=8, labels="greedy", seed=0, epoch=0, pin_memory=True)
           for i, lengths in enumerate([[25, 18], [30, 11]])]
    microbatch_loss(model, mbs[0], attention=attention, chunk=16)[0].backward()  # compiles outside the check
    stats = BlockStats.zeros(4, "cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for mb in mbs:
            loss, st = microbatch_loss(model, mb, attention=attention, chunk=16)
            loss.backward()
            stats.add(st)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert stats.summary()["positions"] > 0


@pytest.mark.parametrize("reduced", [False, True])
def test_kl_to_a_one_hot_topk_on_the_greedy_token_is_the_greedy_cross_entropy(reduced):
    """Top-k whose mass is all on the greedy token (the rest far below) make the kl loss the ce loss,
    slot for slot: the top-k travel with their documents to the labelled slots' source positions, and
    with a reduced vocab the greedy ids outside it are dropped (the other top-k ids are outside too)
    exactly as ce drops them. Moving the mass to an id the vocab has scores those slots as well."""
    from dflash_train.model.init import reduce_drafter_vocab

    model = base = tiny_model()
    if reduced:  # 120 of 300 ids: about 60% of the greedy labels fall outside
        counts = torch.zeros(V, dtype=torch.long)
        counts[torch.randperm(V, generator=torch.Generator().manual_seed(4))[:120]] = 1
        model = reduce_drafter_vocab(base, counts, 120, base._target_lm_head)
        model.attach_target_weights(base._target_embed, base._target_lm_head)
    outside = (~model.t2d).nonzero().squeeze(1) if reduced else torch.arange(V)
    docs = random_docs([40, 31, 52])
    for d in docs:
        rest = outside[torch.randint(0, outside.numel(), (len(d), 5), generator=torch.Generator().manual_seed(len(d)))]
        d.target_topk_ids = torch.cat([d.greedy_next[:, None], rest], 1).int()
        d.target_topk_logp = torch.tensor([0.0, -200.0, -200.0, -200.0, -200.0, -200.0]).expand(len(d), 6).bfloat16()
    mb = build_microbatch(docs, [0, 1, 2], block_size=4, anchors_per_document=12, labels="greedy", seed=0, epoch=0)
    assert mb.target_topk[0].shape == (int(mb.valid.sum()), 6)
    ce, ce_stats = microbatch_loss(model, mb, loss="ce", chunk=16)
    kl, kl_stats = microbatch_loss(model, mb, loss="kl", chunk=16)
    torch.testing.assert_close(kl, ce, atol=1e-4, rtol=1e-5)
    assert torch.equal(kl_stats.correct, ce_stats.correct)
    if reduced:  # the greedy id is outside the vocab: the mass moves to the first top-k id inside it
        inside = model.t2d.nonzero().squeeze(1)
        for d in docs:
            d.target_topk_ids[:, 1] = inside[d.greedy_next % inside.numel()].int()
        mb = build_microbatch(docs, [0, 1, 2], block_size=4, anchors_per_document=12, labels="greedy", seed=0,
                              epoch=0)
        more, _ = microbatch_loss(model, mb, loss="kl", chunk=16)
        assert float(more.detach()) > float(ce.detach()) + 1.0  # the slots ce skips now carry a loss



def test_a_cold_kl_teacher_is_the_greedy_cross_entropy():
    """objective.kl_temperature reaches the step's loss: a top-k one nat apart is a soft teacher at 1 (its kl
    is not the ce), and divided by 0.01 all of its mass is on the greedy token (its kl is the ce)."""
    model, docs = tiny_model(), random_docs([40, 31, 52])
    for d in docs:
        rest = torch.randint(0, V, (len(d), 3), generator=torch.Generator().manual_seed(len(d)))
        rest = torch.where(rest == d.greedy_next[:, None], (rest + 1) % V, rest)
        d.target_topk_ids = torch.cat([d.greedy_next[:, None], rest], 1).int()
        d.target_topk_logp = torch.tensor([0.0, -1.0, -2.0, -3.0]).expand(len(d), 4).bfloat16()
    mb = build_microbatch(docs, [0, 1, 2], block_size=4, anchors_per_document=12, labels="greedy", seed=0, epoch=0)
    ce, _ = microbatch_loss(model, mb, loss="ce", chunk=16)
    warm, _ = microbatch_loss(model, mb, loss="kl", chunk=16)
    cold, _ = microbatch_loss(model, mb, loss="kl", chunk=16, kl_temperature=0.01)
    torch.testing.assert_close(cold, ce, atol=1e-4, rtol=1e-5)
    assert abs(float(warm.detach()) - float(ce.detach())) > 1.0

def zero_stage_step(stage: int) -> dict:
    """One training step of a reduced-vocabulary drafter (frozen head) through a real DeepSpeed engine at
    `stage` (fp32, gloo world of one): the loss, and every weight after the step, gathered."""
    from dflash_train.model.init import reduce_drafter_vocab
    from dflash_train.train.batches import head_rows
    from dflash_train.train.engine import build_engine, gathered_params, init_distributed
    from dflash_train.train.recipe import load_recipe

    init_distributed()
    model = tiny_model(layers=1)
    counts = torch.arange(V, dtype=torch.float64)
    model = reduce_drafter_vocab(model, counts, 64, model._target_lm_head)
    model.attach_target_weights(tiny_model(layers=1)._target_embed, tiny_model(layers=1)._target_lm_head)
    model.lm_head.weight.requires_grad_(False)
    recipe = load_recipe(None, base={"data": {"prepared": "rows"}, "optim": {"lr": 1e-2},
                                     "engine": {"zero_stage": stage, "precision": "fp32"}}).recipe
    engine, _ = build_engine(model, recipe, 10)
    mb = build_microbatch(random_docs([40, 30]), [0, 1], block_size=4, anchors_per_document=6, labels="greedy",
                          seed=0, epoch=0)
    loss, stats = microbatch_loss(engine.module, mb)
    engine.backward(loss)
    engine.step()
    with gathered_params(engine):
        weights = {k: v.detach().clone().tolist() for k, v in engine.module.named_parameters()}
    return {"loss": float(loss), "rows": head_rows(engine.module), "weights": weights,
            "partitioned": hasattr(engine.module.lm_head.weight, "ds_id")}


@pytest.mark.slow
def test_zero3_reads_the_partitioned_frozen_head_gathered_and_equals_zero0():
    """ZeRO-3 partitions the reduced head, which the fused head reads outside a module call: it is gathered
    for the head (batches.full_head_weight), so a ZeRO-3 step equals a ZeRO-0 step. Real DeepSpeed on
    CPU/gloo, each stage in its own process (a process group per run)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    results = {}
    for stage in (0, 3):
        code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"from test_batches import zero_stage_step; print(json.dumps(zero_stage_step({stage})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                             env={**__import__("os").environ, "PYTHONWARNINGS": "ignore"})
        assert out.returncode == 0, out.stderr[-3000:]
        results[stage] = json.loads(out.stdout.strip().splitlines()[-1])
    z0, z3 = results[0], results[3]
    assert z3["partitioned"] and not z0["partitioned"] and z3["rows"] == z0["rows"] == 64
    assert abs(z3["loss"] - z0["loss"]) <= 1e-5 * abs(z0["loss"])
    # one AdamW step at lr 1e-2 moves each weight by up to ~1e-2; the two stages' optimizers (torch's fused
    # AdamW without ZeRO, DeepSpeed's partitioned one) differ by summation order, which Adam's normalisation
    # can scale up for a near-zero gradient (2.4e-6 seen on fc.weight): 1e-5 is a thousandth of the step,
    # while reading a wrong head partition changes every weight by the step's size
    for name, w in z0["weights"].items():
        torch.testing.assert_close(torch.tensor(z3["weights"][name]), torch.tensor(w), rtol=1e-5, atol=1e-5,
                                   msg=name)
    assert z3["weights"]["lm_head.weight"] == z0["weights"]["lm_head.weight"]  # frozen: untouched


def test_a_trained_reduced_head_under_zero3_is_refused_by_the_recipe():
    from dflash_train.errors import ConfigError
    from dflash_train.train.recipe import load_recipe

    with pytest.raises(ConfigError, match="train_lm_head.*zero_stage 2"):
        load_recipe(None, base={"data": {"prepared": "rows"}, "engine": {"zero_stage": 3},
                                "drafter": {"draft_vocab_size": 64, "train_lm_head": True}})
    # the drafter's embeds are read outside a module's forward, where ZeRO-3 would hand them over partitioned
    with pytest.raises(ConfigError, match="train_mask_embedding.*zero_stage 2"):
        load_recipe(None, base={"data": {"prepared": "rows"}, "engine": {"zero_stage": 3},
                                "drafter": {"train_mask_embedding": True}})


@pytest.mark.parametrize("autocast,frozen_head,kind", [(False, True, True), (True, True, True), (False, False, True),
                                                       (False, True, "expected_length"),
                                                       (False, False, "expected_length")])
def test_prefix_weighting_scales_each_slot_by_the_drafters_chance_of_reaching_it(autocast, frozen_head, kind):
    """objective.prefix_weighting equals the plain loss with each slot's weight times the product, over the
    slots before it in its block, of the drafter's probability of their labels (no gradient through it):
    in the head's one pass (a frozen head), and in a separate pass first (a trained head).
    expected_length: times the sum over the labelled slots j >= k of the product over slots <= j of
    (p + 1) / 2 (D-PACE's smoothing 0.5)."""
    import dataclasses
    from contextlib import nullcontext

    from dflash_train.train.batches import head_weight

    model = tiny_model(block_size=4, layers=1)
    head_weight(model).requires_grad_(not frozen_head)
    docs = random_docs([20, 31, 12])
    mb = build_microbatch(docs, [0, 1, 2], block_size=4, anchors_per_document=6, labels="greedy", seed=0, epoch=0)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()

    def run(batch, prefix):
        model.zero_grad()
        with amp:
            loss, _ = microbatch_loss(model, batch, chunk=7, prefix_weighting=kind if prefix else False)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if not frozen_head:
            grads["head"], head_weight(model).grad = head_weight(model).grad.clone(), None
        return float(loss.detach()), grads

    # the reference: every block's label probabilities from one plain forward, products taken slot by slot
    with torch.no_grad(), amp:
        first = mb.packed.input_ids[mb.anchors]
        embeds = model.embed(model.block_ids(first)[:, : mb.labels.shape[1]])
        hidden = model.forward_train(mb.packed.features, embeds, mb.layout, attention="split")
        probs = torch.softmax((hidden.float() @ head_weight(model).float().t()), -1)
    scale = torch.ones_like(mb.weights)
    for n in range(mb.labels.shape[0]):
        reach, reached = 1.0, []
        for k in range(mb.labels.shape[1]):
            scale[n, k] = reach
            if mb.labels[n, k] != IGNORE:
                p = float(probs[n, k, mb.labels[n, k]])
                reach *= p if kind is True else (p + 1) / 2
                reached.append((k, reach))
        if kind == "expected_length":
            for k, _ in reached:
                scale[n, k] = sum(r for j, r in reached if j >= k)
    if kind is True:
        assert 0 < float(scale[:, 2:][mb.valid[:, 2:]].max()) < 1 and torch.all(scale[:, :2] == 1)
    else:
        both = mb.valid[:, 1] & mb.valid[:, 2]  # slot 1 counts for the slots after it too: more than slot 2
        assert both.any() and torch.all(scale[:, 1][both] > scale[:, 2][both])
    weighted = dataclasses.replace(mb, weights=mb.weights * scale)
    loss_p, grads_p = run(mb, True)
    loss_r, grads_r = run(weighted, False)
    loss_0, _ = run(mb, False)
    tol = 2e-2 if autocast else 1e-5
    assert loss_p == pytest.approx(loss_r, rel=tol) and abs(loss_p - loss_0) > 0.1 * loss_0
    for name in grads_r:
        assert torch.allclose(grads_p[name], grads_r[name], rtol=tol, atol=tol * float(grads_r[name].abs().max())), name


def _plain_and_weighted(**weighting):
    """A 1-layer drafter and two documents (rows 7 and 9) as a micro-batch without and with `weighting`
    (factors 0.5 for row 7, 3.0 for row 9)."""
    docs = random_docs([20, 31])
    kw = dict(block_size=4, anchors_per_document=5, labels="greedy", seed=0, epoch=0)
    plain = build_microbatch(docs, [7, 9], **kw)
    weighted = build_microbatch(docs, [7, 9], **{k: {7: 0.5, 9: 3.0} for k in weighting}, **kw)
    return tiny_model(layers=1), plain, weighted


def test_row_weight_scales_the_blocks_acceptance_weight_not_the_loss():
    model, plain, weighted = _plain_and_weighted(row_weight=True)
    assert torch.equal(plain.anchors, weighted.anchors) and torch.equal(plain.weights, weighted.weights)
    doc = plain.packed.doc_ids[plain.anchors]
    assert torch.allclose(weighted.block_weight, plain.block_weight * torch.where(doc == 0, 0.5, 3.0))
    a, sa = microbatch_loss(model, plain)
    b, sb = microbatch_loss(model, weighted)
    assert float(a.detach()) == float(b.detach()) and torch.equal(sa.accept_sum, sb.accept_sum)
    # the per-position acceptance length: each block's length weighted by its (scaled) block weight
    from dflash_train.train.loss import accept_lengths, slot_correct

    _, preds = microbatch_predictions(model, plain)
    lengths = accept_lengths(slot_correct(plain.labels, preds)).double()
    expected = float((weighted.block_weight.double() * lengths).sum() / weighted.block_weight.double().sum())
    assert sb.summary()["accept_len"] == pytest.approx(expected)
    assert float(sb.block_weight) == pytest.approx(float(weighted.block_weight.sum()))


def test_loss_row_weight_scales_each_documents_slot_weights_and_so_the_loss():
    """objective.balance_sources: a row's factor multiplies its blocks' slot weights, so the weighted loss sum
    is each document's own sum times its factor."""
    model, plain, weighted = _plain_and_weighted(loss_row_weight=True)
    assert torch.equal(plain.anchors, weighted.anchors) and torch.equal(plain.block_weight, weighted.block_weight)
    factor = torch.where(plain.packed.doc_ids[plain.anchors] == 0, 0.5, 3.0)
    assert torch.allclose(weighted.weights, plain.weights * factor[:, None])
    assert weighted.weight_sum != pytest.approx(plain.weight_sum)
    # the weighted loss sum is each document's own sum (its blocks alone) times its factor
    from dataclasses import replace

    doc = plain.packed.doc_ids[plain.anchors][:, None]
    with torch.no_grad():  # the loss sums' values only
        own = [float(microbatch_predictions(model, replace(plain, weights=plain.weights * (doc == d)))[0])
               for d in (0, 1)]
        total = float(microbatch_predictions(model, weighted)[0])
        alone = float(microbatch_predictions(model, plain)[0])
    assert total == pytest.approx(0.5 * own[0] + 3.0 * own[1], rel=1e-5)
    assert alone == pytest.approx(own[0] + own[1], rel=1e-5)


class Rows:
    """Prepared rows' documents by row id, served as the training loop's document source serves them; the rows'
    shared template prefix ends at position 2 (the demo recipe trains the prompts' positions after it)."""

    def __init__(self, docs: dict):
        self.docs = docs

    def get(self, rows):
        return [self.docs[r] for r in rows]

    def prompt_start(self):
        return 2


@pytest.mark.parametrize("balance", [False, True])
def test_balance_sources_reaches_the_training_microbatch_only(balance):
    """objective.balance_sources: the step's micro-batches carry the sources' balance in their slot weights;
    the held-out check's (every position) never does."""
    from dflash_train.train.loop import _microbatch
    from dflash_train.train.recipe import load_recipe

    docs = dict(zip([7, 9], random_docs([20, 31]), strict=True))

    recipe = load_recipe("recipes/smollm2-135m-demo.yaml", [f"objective.balance_sources={str(balance).lower()}",
                                                            "drafter.block_size=4"]).recipe
    balance_of = {7: 0.5, 9: 3.0}
    step = _microbatch(recipe, Rows(docs), [7, 9], 0, torch.device("cpu"), row_weight=balance_of)
    plain = _microbatch(recipe, Rows(docs), [7, 9], 0, torch.device("cpu"))
    factor = torch.where(step.packed.doc_ids[step.anchors] == 0, 0.5, 3.0)[:, None]
    assert torch.allclose(step.weights, plain.weights * factor if balance else plain.weights)
    check = _microbatch(recipe, Rows(docs), [7, 9], 0, torch.device("cpu"), every_anchor=True)
    assert float(check.weights.max()) == 1.0  # slot 1's plain weight: no balance factor


def test_feature_noise_is_uniform_in_each_layers_own_scale():
    from dflash_train.train.batches import add_feature_noise

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 3, 64, generator=g) * torch.tensor([1.0, 10.0, 100.0])[None, :, None]  # 3 layers' scales
    flat = x.reshape(512, -1)
    noisy = add_feature_noise(flat, 3, 0.2, torch.Generator().manual_seed(1))
    delta = (noisy - flat).view(512, 3, 64)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    assert bool((delta.abs() <= 0.2 * rms * (1 + 1e-5)).all())
    rel = delta / (0.2 * rms)  # U(-1, 1): mean 0, std 1/sqrt(3)
    assert abs(float(rel.mean())) < 0.02 and float(rel.std()) == pytest.approx(3 ** -0.5, rel=0.03)
    assert torch.equal(noisy, add_feature_noise(flat, 3, 0.2, torch.Generator().manual_seed(1)))
    half = add_feature_noise(flat.to(torch.bfloat16), 3, 0.2, torch.Generator().manual_seed(1))
    assert half.dtype == torch.bfloat16


def test_feature_noise_in_a_microbatch_follows_seed_and_epoch_and_leaves_the_rest():
    docs = random_docs([20, 31])
    kw = dict(block_size=4, anchors_per_document=5, labels="greedy", seed=0)
    clean = build_microbatch(docs, [7, 9], epoch=0, **kw)
    a = build_microbatch(docs, [7, 9], epoch=0, feature_noise=(0.1, 1), **kw)
    b = build_microbatch(docs, [7, 9], epoch=0, feature_noise=(0.1, 1), **kw)
    c = build_microbatch(docs, [7, 9], epoch=1, feature_noise=(0.1, 1), **kw)
    assert torch.equal(a.packed.features, b.packed.features)  # a resumed run: the same noise
    assert not torch.equal(a.packed.features, clean.packed.features)
    assert not torch.equal(a.packed.features, build_microbatch(docs, [7, 9], epoch=1, **kw).packed.features)
    assert not torch.equal(c.packed.features - build_microbatch(docs, [7, 9], epoch=1, **kw).packed.features,
                           a.packed.features - clean.packed.features)  # another epoch, other noise
    for name in ("anchors", "labels", "weights"):
        assert torch.equal(getattr(a, name), getattr(clean, name))
    assert torch.equal(build_microbatch(docs, [7, 9], epoch=0, feature_noise=(0.0, 1), **kw).packed.features,
                       clean.packed.features)


def test_feature_noise_reaches_the_training_microbatch_only():
    from dflash_train.train.loop import _microbatch
    from dflash_train.train.recipe import load_recipe

    docs = dict(zip([7, 9], random_docs([20, 31]), strict=True))

    clean = torch.cat([docs[7].features, docs[9].features])
    recipe = load_recipe("recipes/smollm2-135m-demo.yaml", ["objective.feature_noise=0.1", "drafter.num_features=1",
                                                            "drafter.target_layer_ids=[9]"]).recipe
    step = _microbatch(recipe, Rows(docs), [7, 9], 0, torch.device("cpu"))
    check = _microbatch(recipe, Rows(docs), [7, 9], 0, torch.device("cpu"), every_anchor=True)
    assert torch.equal(check.packed.features, clean) and not torch.equal(step.packed.features, clean)
    assert float((step.packed.features - clean).abs().max()) <= 0.1 * float(clean.pow(2).mean(-1).sqrt().max())


def test_prompt_positions_train_after_the_shared_prefix_on_greedy_labels():
    docs = random_docs([30, 24], seed=3)  # answers from n // 3: positions 10.. and 8..
    kw = dict(block_size=4, anchors_per_document=1000, labels="greedy", seed=0, epoch=0)
    answers = build_microbatch(docs, [0, 1], **kw)
    every = build_microbatch(docs, [0, 1], prompt_from=4, **kw)
    starts = every.packed.doc_start[every.anchors]
    local = (every.anchors - starts).tolist()
    assert sorted(set(local)) == list(range(4, 29))  # every position from 4 to the one before the last
    assert min((answers.anchors - answers.packed.doc_start[answers.anchors]).tolist()) == 8
    for n, a in enumerate(every.anchors.tolist()):  # prompt slots carry the target's greedy token, not the text
        for k in range(1, 4):
            if a + k < int(every.packed.doc_end[a]):
                assert every.labels[n, k] == every.packed.greedy_next[a + k - 1]
    assert torch.equal(docs[0].loss_mask, random_docs([30, 24], seed=3)[0].loss_mask)  # the documents are untouched


def test_dataset_labels_with_prompt_positions_keep_the_answers_tokens_and_take_the_targets_on_prompts():
    """labels: dataset with the prompts' positions: a slot on an answer's token is labelled with that token, one on
    the prompt with the target's argmax; the greedy column may read -1 where an answer's token follows (a cache
    written with greedy="prompts"), never at a prompt's position (refused by name)."""
    docs = random_docs([30, 24], seed=3)  # answers from n // 3: positions 10.. and 8..
    for d in docs:  # as the prompts' cache holds it: no argmax where the next token is an answer's
        d.greedy_next[:-1][d.loss_mask[1:]] = -1
    kw = dict(block_size=4, anchors_per_document=1000, seed=0, epoch=0, prompt_from=4)
    mb = build_microbatch(docs, [0, 1], labels="dataset", **kw)
    answer = torch.cat([d.loss_mask for d in docs])
    greedy = torch.cat([d.greedy_next for d in docs])
    checked = {"answer": 0, "prompt": 0}
    for n, a in enumerate(mb.anchors.tolist()):
        for k in range(1, 4):
            p = a + k
            if p < int(mb.packed.doc_end[a]):
                want = mb.packed.input_ids[p] if answer[p] else greedy[p - 1]
                assert int(mb.labels[n, k]) == int(want) >= 0
                checked["answer" if answer[p] else "prompt"] += 1
    assert min(checked.values()) > 10
    docs[1].greedy_next[5] = -1  # a prompt's position without the target's argmax
    with pytest.raises(ValueError, match="miss one at a prompt's position"):
        build_microbatch(docs, [0, 1], labels="dataset", **kw)


def test_prompt_positions_reach_the_training_microbatch_only():
    from dflash_train.train.loop import _microbatch
    from dflash_train.train.recipe import load_recipe

    docs = dict(zip([7, 9], random_docs([20, 31]), strict=True))

    recipe = load_recipe("recipes/smollm2-135m-demo.yaml", ["objective.positions=all", "objective.labels=greedy",
                                                            "objective.anchors_per_document=1000"]).recipe
    step = _microbatch(recipe, Rows(docs), [7, 9], 0, torch.device("cpu"))
    check = _microbatch(recipe, Rows(docs), [7, 9], 0, torch.device("cpu"), every_anchor=True)
    first = lambda mb: int((mb.anchors - mb.packed.doc_start[mb.anchors]).min())  # noqa: E731
    assert first(step) == 2 and first(check) == 20 // 3
    mixed = load_recipe("recipes/smollm2-135m-demo.yaml", ["objective.positions=all", "objective.labels=dataset",
                                                           "objective.anchors_per_document=1000"]).recipe
    both = _microbatch(mixed, Rows(docs), [7, 9], 0, torch.device("cpu"))
    assert torch.equal(both.anchors, step.anchors)
    slot = both.anchors[:, None] + torch.arange(4)
    on_answer = torch.cat([d.loss_mask for d in docs.values()])[slot.clamp(max=50)] & (both.labels != IGNORE)
    on_prompt = ~on_answer & (both.labels != IGNORE)
    assert int(on_answer.sum()) > 50 and int(on_prompt.sum()) > 20
    assert torch.equal(both.labels[on_answer], both.packed.input_ids[slot[on_answer]])  # the dataset's tokens
    assert torch.equal(both.labels[on_prompt], step.labels[on_prompt])  # the target's, as with greedy labels


def test_repeat_weight_scales_the_blocks_that_repeat_earlier_text_and_reaches_training_only():
    """objective.repeat_weight: blocks whose anchor's 3 tokens and next one occur earlier in the same document
    (data/repeats.py) weigh w in the loss, the others 1; positions are each document's own, so a second
    document's copy of the first is not a repeat; the held-out check weighs all alike."""
    from dflash_train.train.loop import _microbatch
    from dflash_train.train.recipe import load_recipe

    lap = [11, 12, 13, 14, 15]
    first, second = random_docs([20, 30], seed=3)
    first.input_ids[5:20] = torch.tensor(lap * 3)  # a loop of period 5 in the first document's answer
    second.input_ids[:15] = torch.tensor(lap * 3)  # the same text in the second: its own first lap does not repeat
    docs = {7: first, 9: second}
    overrides = ["objective.positions=answers", "drafter.block_size=4", "objective.anchors_per_document=64"]
    plain = _microbatch(load_recipe("recipes/smollm2-135m-demo.yaml", [*overrides, "objective.repeat_weight=1"]).recipe,
                        Rows(docs), [7, 9], 0, torch.device("cpu"))
    recipe = load_recipe("recipes/smollm2-135m-demo.yaml", [*overrides, "objective.repeat_weight=4"]).recipe
    step = _microbatch(recipe, Rows(docs), [7, 9], 0, torch.device("cpu"))
    assert torch.equal(plain.anchors, step.anchors)
    # every candidate is sampled: the first document's anchors 12..18 (its answer starts at 6, the loop at 5) and
    # the second's 10..13 (its answer starts at 10, the loop at 0) repeat: their 3-gram and next token were seen
    # in an earlier lap of their own document
    doc = step.packed.doc_ids[step.anchors]
    local = step.anchors - torch.where(doc == 0, 0, len(first))
    repeats = ((doc == 0) & (local >= 12) & (local <= 18)) | ((doc == 1) & (local >= 10) & (local <= 13))
    assert int(repeats.sum()) == 11 and bool((~repeats).any())
    assert torch.allclose(step.weights, plain.weights * torch.where(repeats, 4.0, 1.0)[:, None])
    check = _microbatch(recipe, Rows(docs), [7, 9], 0, torch.device("cpu"), every_anchor=True)
    assert float(check.weights.max()) == 1.0
