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
    head_loss,
    reference_head_loss,
    slot_correct,
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
    hidden, weight, labels, w, _ = (t.cuda() for t in _head_inputs(m=700, h=256, v=32000))
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        h = hidden.to(dtype, copy=True).requires_grad_()
        out, pred = head_loss(h, weight.to(dtype), labels, w, chunk=auto_logits_chunk(32000, "cuda"))
        out.backward()
        results[dtype] = (float(out), pred, h.grad.float())
    (l32, p32, g32), (l16, p16, g16) = results[torch.float32], results[torch.bfloat16]
    assert abs(l16 - l32) <= 2e-3 * abs(l32) and (p16 == p32).float().mean() >= 0.95
    assert (g16 - g32).abs().max() <= 3e-2 * g32.abs().max()


def test_accept_lengths_stop_at_the_first_wrong_or_unlabelled_slot():
    labels = torch.tensor([[IGNORE, 1, 2, 3], [IGNORE, 4, IGNORE, IGNORE], [IGNORE, 6, 7, 8], [IGNORE] * 4])
    preds = torch.tensor([1, 2, 3, 4, 0, 7, 8])  # the labelled slots, row-major
    correct = slot_correct(labels, preds)
    assert correct.tolist() == [[False, True, True, True], [False, True, False, False],
                                [False, False, True, True], [False] * 4]
    assert accept_lengths(correct).tolist() == [4, 2, 1, 1]
