"""Chunked fused LM-head loss equals the naive all-logits loss; block metrics count right."""

import pytest
import torch

from dflash_train.train.anchors import IGNORE
from dflash_train.train.loss import accept_lengths, block_stats, head_loss, reference_head_loss, slot_correct


@pytest.mark.parametrize("kind", ["ce", "kl"])
@pytest.mark.parametrize("chunk", [1, 7, None])
def test_chunked_equals_unchunked(kind, chunk):
    g = torch.Generator().manual_seed(0)
    m, h, v = 23, 16, 97
    hidden = torch.randn(m, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (m,), generator=g)
    w = torch.rand(m, generator=g)
    tlp = torch.log_softmax(torch.randn(m, v, generator=g), -1)
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


def test_accept_lengths_stop_at_the_first_wrong_or_unlabelled_slot():
    labels = torch.tensor([[IGNORE, 1, 2, 3], [IGNORE, 4, IGNORE, IGNORE], [IGNORE, 6, 7, 8], [IGNORE] * 4])
    preds = torch.tensor([1, 2, 3, 4, 0, 7, 8])  # the labelled slots, row-major
    correct = slot_correct(labels, preds)
    assert correct.tolist() == [[False, True, True, True], [False, True, False, False],
                                [False, False, True, True], [False] * 4]
    assert accept_lengths(correct).tolist() == [4, 2, 1, 1]
