"""What the fused LM head does with one chunk of fp32 logits: the loss, the argmax and the softmax
the gradient needs, eager or compiled into fused kernels (`objective.head`).

Eager, a chunk of [n, V] logits is read and written several times over: the argmax, the log-softmax
(a max, a sum of exponentials, a write), the label's log-probability, the softmax in place, its cast
to the head's dtype. On a GPU those passes, not the matmuls' arithmetic, are what the head's memory
traffic is (~34 bytes per logit; about 15 ms of a 45 ms head at Qwen3-8B drafter shapes on an H100).
`torch.compile` fuses them: one reduction kernel reads the logits for the max, the argmax and the
sum of exponentials (online softmax), and one pointwise kernel writes the softmax in the head's dtype
(~14 bytes per logit). The matmuls stay outside (`torch.mm(..., out_dtype=float32)` on tensor cores).

Why not liger-kernel or cut-cross-entropy: their fused linear cross-entropy returns a loss (and at
most a mean accuracy), not each slot's argmax, which the acceptance statistics need; neither takes a
weight per position (the slot decay w_k) nor the top-k KL target. Inductor gives the same fusion for
exactly the maths below, on every GPU torch supports, with nothing to install.

Compiles: one per (loss kind, gradient or not, gradient dtype), each with the chunk's row count
dynamic, so the last, shorter chunk of a micro-batch and the held-out check's chunks reuse the
kernel (tests/unit/train/test_head_epilogue.py counts them).

A compile that fails on the machine at hand (a Triton or compiler problem, not a bug in the maths)
does not end the run: that epilogue warns once and runs eager from then on (dflash_train/compiled.py).

Both functions are written to run well eager too (CPU's default): each [n, V] temporary is made
once and then updated in place.
"""

from __future__ import annotations

import torch

from dflash_train.compiled import call

# torch's CPU exp (and logsumexp, which calls it) takes a slow path where a float32 result would fall below the
# smallest normal float, an input under about -87: 10-25x the fast path. A trained head's log-probabilities over
# 4,096 ids reach far below it: on 2 Zen 4 cores (2026-12-04) logsumexp and exp over [640, 4096] such logits took
# 15 and 14 ms instead of ~1.3 (bench/bench_cpu_epilogue.py), and the demo's 1,800 steps 252 s instead of 242
# (the profile of a step early in training put them at a fifth of it). So the log-probabilities come from log_softmax
# (its own kernel is fast at any input) and are floored here before exp: each probability moves by at most
# exp(-87) = 1.6e-38. Compiled (a GPU), the floor is one more max in the fused kernel.
EXP_FLOOR = -87.0


def probs_from(logp: torch.Tensor) -> torch.Tensor:
    """exp(logp), in place, with logp floored at EXP_FLOOR."""
    return logp.clamp_(min=EXP_FLOOR).exp_()


def ce_chunk(logits: torch.Tensor, labels: torch.Tensor,
             grad_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(CE per row [n] fp32, argmax [n], softmax [n, V] in `grad_dtype` or None). logits [n, V] fp32,
    labels [n] long. The gradient w.r.t. the logits is softmax - onehot(label); the caller weighs the rows
    and subtracts the one-hot part on the [n, H] products (rows of the head), never on [n, V]."""
    preds = logits.argmax(-1)
    logp = torch.log_softmax(logits, -1)
    loss = -logp.gather(1, labels[:, None]).squeeze(1)
    if grad_dtype is None:
        return loss, preds, None
    return loss, preds, probs_from(logp).to(grad_dtype)


def kl_chunk(logits: torch.Tensor, ids: torch.Tensor, p: torch.Tensor,
             grad_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(KL(p || q) per row [n] fp32, argmax [n], dL/dlogits [n, V] in `grad_dtype` or None). ids [n, k] long
    draft ids, p [n, k] fp32 (entries with p = 0 are ignored). KL = sum_j p_j log p_j - p_j log q(ids_j);
    its gradient w.r.t. the logits is softmax * sum(p) - p scattered to its ids."""
    preds = logits.argmax(-1)
    logp = torch.log_softmax(logits, -1)
    logq = logp.gather(1, ids)
    loss = (torch.xlogy(p, p) - p * logq).sum(-1)
    if grad_dtype is None:
        return loss, preds, None
    d = probs_from(logp).mul_(p.sum(-1, keepdim=True)).scatter_add_(1, ids, -p)
    return loss, preds, d.to(grad_dtype)


KNOB = "objective.head compiled"


def ce(logits, labels, grad_dtype, compiled: bool):
    args = (logits, labels, grad_dtype)
    return call("head ce epilogue", ce_chunk, args, {0: [0], 1: [0]}, KNOB) if compiled else ce_chunk(*args)


def kl(logits, ids, p, grad_dtype, compiled: bool):
    args = (logits, ids, p, grad_dtype)
    return (call("head kl epilogue", kl_chunk, args, {0: [0], 1: [0], 2: [0]}, KNOB) if compiled
            else kl_chunk(*args))
