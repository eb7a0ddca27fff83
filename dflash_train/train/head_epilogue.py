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
does not end the run: that epilogue warns once and runs eager from then on (the same results, slower;
`fallbacks` says which, and why).

Both functions are written to run well eager too (CPU's default): each [n, V] temporary is made
once and then updated in place.
"""

from __future__ import annotations

import warnings

import torch

HEAD_CHOICES = ("auto", "eager", "compiled")


def ce_chunk(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
             grad_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weighted CE sum, argmax [n], softmax [n, V] in `grad_dtype` or None). logits [n, V] fp32,
    labels [n] long, weights [n] fp32. The gradient w.r.t. the logits is softmax - onehot(label); the
    caller subtracts the one-hot part on the [n, H] products (rows of the head), never on [n, V]."""
    preds = logits.argmax(-1)
    lse = torch.logsumexp(logits, -1)
    loss = (weights * (lse - logits.gather(1, labels[:, None]).squeeze(1))).sum()
    if grad_dtype is None:
        return loss, preds, None
    soft = (logits - lse[:, None]).exp_()
    return loss, preds, soft.to(grad_dtype)


def kl_chunk(logits: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, weights: torch.Tensor,
             grad_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weighted KL(p || q) sum, argmax [n], dL/dlogits [n, V] in `grad_dtype` or None). ids [n, k] long
    draft ids, p [n, k] fp32 (entries with p = 0 are ignored). KL = sum_j p_j log p_j - p_j log q(ids_j);
    its gradient w.r.t. the logits is softmax * sum(p) - p scattered to its ids."""
    preds = logits.argmax(-1)
    lse = torch.logsumexp(logits, -1, keepdim=True)
    logq = logits.gather(1, ids) - lse
    loss = (weights * (torch.xlogy(p, p) - p * logq).sum(-1)).sum()
    if grad_dtype is None:
        return loss, preds, None
    d = (logits - lse).exp_().mul_(p.sum(-1, keepdim=True)).scatter_add_(1, ids, -p)
    return loss, preds, d.to(grad_dtype)


_COMPILED: dict[str, object] = {}


def _compiled(name: str, fn):
    if name not in _COMPILED:
        # fullgraph: a graph break here would silently run the slow path; dynamic=None with the row
        # dimension marked below: one kernel for every chunk length, the vocabulary kept static
        _COMPILED[name] = torch.compile(fn, fullgraph=True, dynamic=None)
    return _COMPILED[name]


def _rows_dynamic(*tensors: torch.Tensor) -> None:
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


fallbacks: dict[str, str] = {}  # epilogue -> why it runs eager although compiled was asked for


def _compile_failure(exc: BaseException) -> bool:
    """An error of torch's compiler stack (Dynamo, Inductor, the Triton or C++ build under them)."""
    return (isinstance(exc, torch._dynamo.exc.TorchDynamoException)
            or type(exc).__module__.startswith(("torch._inductor", "triton")))


def _call(name: str, fn, *args):
    if name in fallbacks:
        return fn(*args)
    try:
        return _compiled(name, fn)(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        if not _compile_failure(exc):
            raise
        why = (str(exc).strip().splitlines() or [""])[0][:300]
        fallbacks[name] = f"{type(exc).__name__}: {why}"
        warnings.warn(f"objective.head compiled: the {name} epilogue did not compile here ({fallbacks[name]}); "
                      "it runs eager from now on (same results, slower); objective.head: eager skips the try",
                      stacklevel=3)
        return fn(*args)


def ce(logits, labels, weights, grad_dtype, compiled: bool):
    if not compiled:
        return ce_chunk(logits, labels, weights, grad_dtype)
    _rows_dynamic(logits, labels, weights)
    return _call("ce", ce_chunk, logits, labels, weights, grad_dtype)


def kl(logits, ids, p, weights, grad_dtype, compiled: bool):
    if not compiled:
        return kl_chunk(logits, ids, p, weights, grad_dtype)
    _rows_dynamic(logits, ids, p, weights)
    return _call("kl", kl_chunk, logits, ids, p, weights, grad_dtype)


def resolve_head(choice: str, device: torch.device | str) -> str:
    """`objective.head`: auto is compiled on a CUDA GPU, eager elsewhere (CPU keeps the eager head)."""
    if choice == "auto":
        return "compiled" if torch.device(device).type == "cuda" else "eager"
    if choice not in HEAD_CHOICES:
        raise ValueError(f"objective.head {choice!r}: choose one of {', '.join(HEAD_CHOICES)}")
    return choice

