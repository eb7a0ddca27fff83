"""Chunked fused LM-head loss equals the naive all-logits loss (fp32 exactly as before, bf16 to bf16
tolerance, never copying the head); block metrics count right."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dflash_train.train.anchors import IGNORE
from dflash_train.train.loss import (
    accept_lengths,
    auto_logits_chunk,
    block_stats,
    expected_length_weights,
    head_loss,
    head_matmul_dtype,
    reference_head_loss,
    slot_correct,
    topk_soft_targets,
)


def _full_target(logp):
    """The kl target over the whole vocabulary (k = V): every id with its probability."""
    return torch.arange(logp.shape[1]).expand(logp.shape).clone(), logp.exp()


@pytest.mark.parametrize("kind", ["ce", "kl"])
@pytest.mark.parametrize("chunk", [1, 7, None])
def test_chunked_equals_unchunked(kind, chunk):
    g = torch.Generator().manual_seed(0)
    m, h, v = 23, 16, 97
    hidden = torch.randn(m, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (m,), generator=g)
    w = torch.rand(m, generator=g)
    tlp = _full_target(torch.log_softmax(torch.randn(m, v, generator=g), -1))
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref, ref_pred = reference_head_loss(h1, w1, labels, w, kind, tlp)
    out, pred = head_loss(h2, w2, labels, w, kind, tlp, chunk=chunk)
    (ref * 0.5).backward()
    (out * 0.5).backward()
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-6)
    assert torch.equal(pred, ref_pred)
    assert torch.allclose(h2.grad, h1.grad, atol=1e-6)
    assert torch.allclose(w2.grad, w1.grad, atol=1e-5)


def test_frozen_head_gets_no_grad_and_eval_mode_skips_grads():
    hidden = torch.randn(5, 4, requires_grad=True)
    weight = torch.randn(11, 4)
    loss, _ = head_loss(hidden, weight, torch.arange(5), torch.ones(5), chunk=2)
    loss.backward()
    assert hidden.grad is not None and weight.grad is None
    with torch.no_grad():
        loss2, _ = head_loss(hidden, weight, torch.arange(5), torch.ones(5), chunk=2)
    assert torch.allclose(loss2, loss.detach())


def test_block_stats_acceptance_and_accuracy():
    labels = torch.tensor([[IGNORE, 1, 2, 3], [IGNORE, 4, 5, IGNORE], [IGNORE, 6, 7, 8]])
    weights = (labels != IGNORE).float()
    # predictions for the valid slots, row-major: block 0 all right, block 1 first wrong, block 2 right,right,wrong
    preds = torch.tensor([1, 2, 3, 0, 5, 6, 7, 0])
    s = block_stats(torch.tensor(2.0), labels, weights, preds).summary()
    assert s["accept_len"] == pytest.approx((4 + 1 + 3) / 3)
    assert s["acc"] == pytest.approx([2 / 3, 1.0, 1 / 2])
    assert s["loss"] == pytest.approx(2.0 / 8)


def _blocks(pattern: list[list[bool]]) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [N, 4] (slot 0 unlabelled) and row-major predictions right or wrong as `pattern` says."""
    labels = torch.tensor([[IGNORE, 1, 2, 3]] * len(pattern))
    preds = torch.tensor([t if ok else 0 for row in pattern for t, ok in zip((1, 2, 3), row, strict=True)])
    return labels, preds


def test_per_position_acceptance_weights_each_block_by_its_documents_candidates():
    """Document A: 8 candidates, 2 sampled blocks accepting 3 each (weight 8/2); document B: 2 candidates,
    both sampled, accepting 1 each (weight 1). Per block (3+3+1+1)/4 = 2.0; per position
    (4*3*2 + 1*1*2) / (8+2) = 2.6, the mean of a block at each of the 10 positions when every position of
    A accepts 3 and every one of B accepts 1."""
    three, one = [True, True, False], [False, True, True]
    labels, preds = _blocks([three, three, one, one])
    sampled = block_stats(torch.tensor(0.0), labels, (labels != IGNORE).float(), preds,
                          block_weight=torch.tensor([4.0, 4.0, 1.0, 1.0])).summary()
    assert sampled["accept_len_per_block"] == pytest.approx(2.0)
    assert sampled["accept_len"] == pytest.approx(2.6)
    labels, preds = _blocks([three] * 8 + [one] * 2)
    every = block_stats(torch.tensor(0.0), labels, (labels != IGNORE).float(), preds).summary()
    assert every["accept_len"] == every["accept_len_per_block"] == pytest.approx(sampled["accept_len"])
    # summed over micro-batches (the step's window) the weighting holds: A and B apart, then added
    parts = [block_stats(torch.tensor(0.0), *_with_weights(_blocks(p), w)) for p, w in
             (([three, three], 4.0), ([one, one], 1.0))]
    total = parts[0].add(parts[1]).summary()
    assert total["accept_len"] == pytest.approx(2.6) and total["accept_len_per_block"] == pytest.approx(2.0)


def _with_weights(blocks, w):
    labels, preds = blocks
    return labels, (labels != IGNORE).float(), preds, None, torch.full((labels.shape[0],), w)


def _head_inputs(m=96, h=64, v=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, h, generator=g), torch.randn(v, h, generator=g) * 0.5, torch.randint(0, v, (m,), generator=g),
            torch.rand(m, generator=g), _full_target(torch.log_softmax(torch.randn(m, v, generator=g), -1)))


@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_half_precision_head_equals_the_fp32_path_to_bf16_tolerance(kind):
    hidden, weight, labels, w, tlp = _head_inputs()
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        h = hidden.to(dtype, copy=True).requires_grad_()
        wt = weight.to(dtype, copy=True).requires_grad_()  # a trainable (reduced-vocab) head: its gradient too
        out, pred = head_loss(h, wt, labels, w, kind, tlp, chunk=40)
        (out * 0.5).backward()
        assert out.dtype == torch.float32 and h.grad.dtype == dtype and wt.grad.dtype == dtype
        results[dtype] = (out.detach(), pred, h.grad.float(), wt.grad.float())
    (l32, p32, gh32, gw32), (l16, p16, gh16, gw16) = results[torch.float32], results[torch.bfloat16]
    assert abs(float(l16) - float(l32)) <= 2e-3 * abs(float(l32))
    assert (p16 == p32).float().mean() >= 0.95  # argmax ties move under bf16 rounding, rarely
    for a, b in ((gh16, gh32), (gw16, gw32)):
        assert (a - b).abs().max() <= 3e-2 * b.abs().max()  # bf16 inputs: ~2^-8 relative each


def test_head_under_autocast_takes_the_bf16_path_with_fp32_weights_and_grads():
    """bf16-mixed: fp32 hidden states and head under torch.autocast give the half path's loss (fp32
    log-softmax, not a bf16 one) and fp32 gradients for the fp32 parameters."""
    hidden, weight, labels, w, _ = _head_inputs()
    ref_h, ref_w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    ref, ref_pred = head_loss(ref_h, ref_w, labels, w, chunk=40)
    ref.backward()
    h, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, pred = head_loss(h, wt, labels, w, chunk=40)
    out.backward()
    assert out.dtype == torch.float32 and h.grad.dtype == torch.float32 and wt.grad.dtype == torch.float32
    assert float(out.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    assert torch.equal(pred, ref_pred)
    torch.testing.assert_close(h.grad, ref_h.grad.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(wt.grad, ref_w.grad.float(), rtol=1e-2, atol=1e-3)
    fp32, _ = head_loss(hidden, weight, labels, w, chunk=40)
    assert abs(float(out.detach()) - float(fp32)) <= 2e-3 * abs(float(fp32))


class _Allocations(TorchDispatchMode):
    """Records the shape and dtype of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen += [(tuple(t.shape), t.dtype) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_bf16_head_is_never_copied():
    hidden, weight, labels, w, _ = _head_inputs(v=997)
    head = weight.bfloat16()  # the frozen target head, as the GPU engine holds it
    for dtype, copies in ((torch.bfloat16, 0), (torch.float32, 1)):  # fp32 hidden: upcast, as before
        h = hidden.to(dtype, copy=True).requires_grad_()
        with _Allocations() as allocs:
            out, _ = head_loss(h, head, labels, w, chunk=32)
            out.backward()
        assert sum(shape == tuple(head.shape) for shape, _ in allocs.seen) == copies


def test_head_matmul_dtype_keeps_cpu_fp32_exact_and_never_upcasts_a_gpu_head():
    f32, bf16 = torch.float32, torch.bfloat16
    assert head_matmul_dtype(f32, f32, "cuda") == f32 and head_matmul_dtype(f32, bf16, "cpu") == f32
    assert head_matmul_dtype(f32, bf16, "cuda") == bf16  # engine.precision fp32 with the bf16 target head
    assert head_matmul_dtype(bf16, bf16, "cpu") == bf16 and head_matmul_dtype(bf16, f32, "cuda") == bf16


def test_fp32_hidden_against_a_bf16_head_on_gpu_takes_the_bf16_path(monkeypatch):
    """`engine.precision: fp32` on a GPU: fp32 hidden states, the bf16 target head. The CUDA choice of
    `head_matmul_dtype` (patched in on CPU) rounds the hidden chunks instead of copying the head to fp32,
    and stays within bf16 rounding of the fp32 head; the gradient keeps the hidden states' fp32."""
    import dflash_train.train.loss as loss_mod

    real = loss_mod.head_matmul_dtype
    hidden, weight, labels, w, _ = _head_inputs(v=997)
    head = weight.bfloat16()
    ref = hidden.clone().requires_grad_()
    ref_loss, ref_pred = head_loss(ref, head.float(), labels, w, chunk=32)
    ref_loss.backward()
    monkeypatch.setattr(loss_mod, "head_matmul_dtype", lambda h, wd, _dev: real(h, wd, "cuda"))
    h = hidden.clone().requires_grad_()
    with _Allocations() as allocs:
        out, pred = head_loss(h, head, labels, w, chunk=32)
        out.backward()
    assert sum(shape == tuple(head.shape) for shape, _ in allocs.seen) == 0  # the old path made one fp32 copy
    assert h.grad.dtype == torch.float32 and abs(float(out) - float(ref_loss)) <= 5e-3 * abs(float(ref_loss))
    assert (pred == ref_pred).float().mean() >= 0.95
    assert (h.grad - ref.grad).abs().max() <= 3e-2 * ref.grad.abs().max()


def test_auto_logits_chunk_fits_two_gib_on_gpu_and_stays_1024_on_cpu():
    assert auto_logits_chunk(151936, "cpu") == 1024
    assert auto_logits_chunk(151936, "cuda") == 1280 and auto_logits_chunk(49152, "cuda") == 4352
    for vocab in (4096, 32000, 49152, 128256, 151936, 262144):
        c = auto_logits_chunk(vocab, "cuda")
        assert c % 256 == 0 and 256 <= c <= 8192 and (10 * c * vocab <= 2 << 30 or c == 256)


@pytest.mark.gpu
def test_bf16_head_on_gpu_equals_the_fp32_head():
    """The CUDA path: torch.mm(..., out_dtype=float32) on bf16 operands (tensor cores, fp32 out)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    hidden, weight, labels, w = (t.cuda() for t in _head_inputs(m=700, h=256, v=32000)[:4])  # [4]: the kl target
    results = {}
    # fp32 hidden against the bf16 head: `engine.precision: fp32` on a GPU (the head is never upcast)
    for name, (hd, wd) in {"fp32": (torch.float32,) * 2, "bf16": (torch.bfloat16,) * 2,
                           "fp32-hidden": (torch.float32, torch.bfloat16)}.items():
        h = hidden.to(hd, copy=True).requires_grad_()
        out, pred = head_loss(h, weight.to(wd), labels, w, chunk=auto_logits_chunk(32000, "cuda"))
        out.backward()
        results[name] = (float(out), pred, h.grad.float())
    l32, p32, g32 = results["fp32"]
    for name in ("bf16", "fp32-hidden"):
        l16, p16, g16 = results[name]
        assert abs(l16 - l32) <= 2e-3 * abs(l32) and (p16 == p32).float().mean() >= 0.95, name
        assert (g16 - g32).abs().max() <= 3e-2 * g32.abs().max(), name


def test_accept_lengths_stop_at_the_first_wrong_or_unlabelled_slot():
    labels = torch.tensor([[IGNORE, 1, 2, 3], [IGNORE, 4, IGNORE, IGNORE], [IGNORE, 6, 7, 8], [IGNORE] * 4])
    preds = torch.tensor([1, 2, 3, 4, 0, 7, 8])  # the labelled slots, row-major
    correct = slot_correct(labels, preds)
    assert correct.tolist() == [[False, True, True, True], [False, True, False, False],
                                [False, False, True, True], [False] * 4]
    assert accept_lengths(correct).tolist() == [4, 2, 1, 1]


def _topk_inputs(m=29, h=16, v=97, k=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(m, h, generator=g), torch.randn(v, h, generator=g)
    logp, ids = torch.log_softmax(torch.randn(m, v, generator=g) * 3, -1).topk(k, dim=-1)
    return hidden, weight, ids.int(), logp, torch.randint(0, v, (m,), generator=g), torch.rand(m, generator=g)


def _dense_teacher(ids, logp, kept, labels):
    """An independent dense reference of the teacher: [M, Vd] probabilities over the draft vocab
    `kept` (sorted target ids), the target's top-k renormalised over the kept ones, or one-hot on the
    label where none is kept; and which rows can be scored at all."""
    index = {int(t): d for d, t in enumerate(kept)}
    p = torch.zeros(ids.shape[0], len(kept))
    scored = torch.ones(ids.shape[0], dtype=torch.bool)
    for r in range(ids.shape[0]):
        cols = [(index[int(t)], float(lp)) for t, lp in zip(ids[r], logp[r], strict=True) if int(t) in index]
        if cols:
            z = sum(torch.tensor(lp).exp() for _, lp in cols)
            for c, lp in cols:
                p[r, c] = float(torch.tensor(lp).exp() / z)
        elif int(labels[r]) in index:
            p[r, index[int(labels[r])]] = 1.0
        else:
            scored[r] = False
    return p, scored


def _to_draft(target_ids, kept):
    """target ids -> draft ids (-100 outside the draft vocab), as DFlashDraftModel.target_to_draft does."""
    lookup = torch.full((int(kept.max()) + 1 + 1000,), -100, dtype=torch.long)
    lookup[kept] = torch.arange(kept.numel())
    return lookup[target_ids.long()]


@pytest.mark.parametrize("reduced", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, None])
def test_topk_kl_loss_and_grads_equal_a_dense_autograd_kl(reduced, chunk):
    hidden, weight, ids, logp, labels, w = _topk_inputs()
    v = weight.shape[0]
    kept = torch.arange(v)
    if reduced:  # a draft vocab of 40 of the 97 ids: some rows keep part of their top-k, some none
        kept = torch.sort(torch.randperm(v, generator=torch.Generator().manual_seed(3))[:40]).values
        ids[0] = torch.tensor([i for i in range(v) if i not in set(kept.tolist())][:ids.shape[1]])  # none kept
        ids[1] = ids[0]
        labels[0], labels[1] = kept[7], [i for i in range(v) if i not in set(kept.tolist())][-1]
    head = weight[kept]
    draft_labels = _to_draft(labels, kept)
    p_dense, scored = _dense_teacher(ids, logp, kept, labels)
    tids, p, scored_fused = topk_soft_targets(_to_draft(ids, kept), logp, draft_labels)
    assert torch.equal(scored_fused, scored)
    if reduced:
        assert not scored[1] and scored[0] and p_dense[0, 7] == 1.0  # fallback to the label, or unscored
        in_vocab = (_to_draft(ids, kept) >= 0).sum(1)
        assert ((in_vocab > 0) & (in_vocab < ids.shape[1])).any()  # rows renormalised over part of their top-k
    # the dense autograd KL(p || q), over the draft vocab, weighted per row
    h1, w1 = hidden.clone().requires_grad_(), head.clone().requires_grad_()
    logq = torch.log_softmax(h1 @ w1.t(), -1)
    ref = (w * scored * (torch.xlogy(p_dense, p_dense) - p_dense * logq).sum(-1)).sum()
    h2, w2 = hidden.clone().requires_grad_(), head.clone().requires_grad_()
    out, pred = head_loss(h2, w2, draft_labels.clamp(min=0), w * scored_fused, "kl", (tids, p), chunk=chunk)
    (ref * 0.7).backward()
    (out * 0.7).backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h2.grad, h1.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w2.grad, w1.grad, atol=1e-5, rtol=1e-5)
    assert torch.equal(pred, (hidden @ head.t()).argmax(-1))
    assert float(out.detach()) >= 0  # a KL, not only a soft cross-entropy
    r_out, _ = reference_head_loss(hidden, head, draft_labels.clamp(min=0), w * scored_fused, "kl", (tids, p))
    torch.testing.assert_close(r_out, ref.detach(), atol=1e-5, rtol=1e-5)


def test_topk_with_k_equal_to_the_vocab_is_the_old_full_kl():
    g = torch.Generator().manual_seed(5)
    m, h, v = 17, 12, 53
    hidden, weight, w = torch.randn(m, h, generator=g), torch.randn(v, h, generator=g), torch.rand(m, generator=g)
    tlp = torch.log_softmax(torch.randn(m, v, generator=g), -1)
    logp_k, ids_k = tlp.topk(v, dim=-1)  # k = V, sorted: every id once
    tids, p, scored = topk_soft_targets(ids_k, logp_k, torch.zeros(m, dtype=torch.long))
    assert scored.all() and torch.allclose(p.sum(-1), torch.ones(m), atol=1e-6)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    logq = torch.log_softmax(h1 @ weight.t(), -1)
    old = (w * (tlp.exp() * (tlp - logq)).sum(-1)).sum()  # the full-vocabulary KL the loss used to take
    new, _ = head_loss(h2, weight, torch.zeros(m, dtype=torch.long), w, "kl", (tids, p), chunk=4)
    old.backward()
    new.backward()
    torch.testing.assert_close(new, old, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h2.grad, h1.grad, atol=1e-6, rtol=1e-5)


def test_a_one_hot_teacher_is_cross_entropy():
    hidden, weight, _, _, labels, w = _topk_inputs(k=3)
    ids = torch.stack([labels, (labels + 1) % weight.shape[0], (labels + 2) % weight.shape[0]], 1)
    p = torch.tensor([1.0, 0.0, 0.0]).expand(ids.shape)
    kl, _ = head_loss(hidden, weight, labels, w, "kl", (ids, p), chunk=8)
    ce, _ = head_loss(hidden, weight, labels, w, "ce", chunk=8)
    torch.testing.assert_close(kl, ce, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("kind", ["ce", "kl"])
@pytest.mark.parametrize("kept_bytes", [256 << 20, 0])  # dL/dlogits kept for the end, or a pass of their own first
def test_reweight_equals_the_loss_with_weights_scaled_beforehand(monkeypatch, kind, kept_bytes):
    """head_loss(reweight=f) is head_loss with weights * f(p(label)) (no gradient through f), for both losses
    and a trained head: loss, input gradient and head gradient, in one pass or with the probabilities first."""
    from dflash_train.train import loss as loss_mod

    monkeypatch.setattr(loss_mod, "_KEPT_BYTES", kept_bytes)
    hidden, weight, _, _, labels, w = _topk_inputs(k=3)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, weight.shape[0], (hidden.shape[0], 3), generator=g)
    target = (ids, torch.softmax(torch.randn(ids.shape, generator=g), -1)) if kind == "kl" else None
    factor = lambda probs: 0.5 + probs.square()  # noqa: E731

    def run(weights, reweight):
        h, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out, preds = head_loss(h, wt, labels, weights, kind, target, chunk=5, reweight=reweight)
        (out * 0.3).backward()
        return out.detach(), preds, h.grad, wt.grad

    probs = torch.softmax(hidden @ weight.t(), -1).gather(1, labels[:, None]).squeeze(1)
    got, ref = run(w, factor), run(w * factor(probs), None)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    plain = run(w, None)
    assert not torch.allclose(got[3], plain[3], atol=1e-3)  # the factors reach the head's gradient


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_the_kl_teachers_temperature_divides_the_kept_log_probs(temperature):
    g = torch.Generator().manual_seed(11)
    m, v, k = 9, 30, 6
    tlp = torch.log_softmax(torch.randn(m, v, generator=g) * 3, -1)
    logp_k, ids_k = tlp.topk(k, dim=-1)
    kept = torch.sort(torch.randperm(v, generator=g)[:20]).values
    draft_ids = _to_draft(ids_k, kept)
    labels = _to_draft(ids_k[:, 0], kept)
    tids, p, _ = topk_soft_targets(draft_ids, logp_k, labels, temperature)
    _, p1, _ = topk_soft_targets(draft_ids, logp_k, labels)
    for r in range(m):
        keep = draft_ids[r] >= 0
        if not keep.any():
            continue
        want = torch.softmax(logp_k[r][keep] / temperature, -1)  # renormalised over the kept ids after dividing
        torch.testing.assert_close(p[r][keep], want)
        assert torch.equal(tids[r][keep], draft_ids[r][keep])
        # sharper below 1 and flatter above: the teacher's top kept id gains or loses mass against temperature 1
        if keep.sum() > 1:
            top = int(torch.nonzero(keep)[0])
            assert (p[r, top] > p1[r, top]) == (temperature < 1)


def test_expected_length_weights_are_the_gradient_of_the_blocks_expected_accepted_length():
    """Slot k's weight is d E[accepted] / d log p_k with E = sum_j prod_{i<=j} p~_i, p~ = (1 - a) p + a, over
    a block's labelled slots (autograd on the closed form); unlabelled slots neither multiply nor count."""
    torch.manual_seed(0)
    n, b = 5, 6
    valid = torch.rand(n, b) > 0.25
    valid[:, 0] = False  # the anchor: never labelled
    index = valid.flatten().nonzero().squeeze(1)
    probs = torch.rand(index.numel()) * 0.9 + 0.05
    for a in (0.0, 0.5):
        log_p = probs.log().requires_grad_()
        full = torch.ones(n * b).index_put((index,), (1 - a) * log_p.exp() + a).view(n, b)
        reach = torch.cumprod(full, 1) * valid
        reach.sum().backward()
        # d/dlog p_k of p~_k is (1 - a) p_k / p~_k: the closed form's weight with that factor divided out
        want = log_p.grad / ((1 - a) * probs / ((1 - a) * probs + a))
        got = expected_length_weights(probs, index, (n, b), smoothing=a)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the last labelled slot of a block counts only for itself: its weight is its own reach probability
    last = valid.cumsum(1).eq(valid.sum(1, keepdim=True)) & valid
    reach0 = torch.cumprod(torch.ones(n * b).index_put((index,), probs).view(n, b), 1)
    torch.testing.assert_close(expected_length_weights(probs, index, (n, b), 0.0)[last.flatten()[index]],
                               reach0[last])
