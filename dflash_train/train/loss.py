"""The weighted block loss with a chunked, fused LM head, and the block metrics.

The LM head over a large vocabulary dominates memory: logits for anchors*B positions would be
[N*B, V]. Only positions that carry a loss get logits at all (slot 0, outside the loss mask
and past the document end are dropped before the head), and those are processed `chunk`
positions at a time. For every chunk the forward computes the loss *and* its gradient with
respect to the hidden states (softmax - target is closed-form), so a chunk's logits are freed
before the next chunk starts and the backward pass never recomputes them (cheaper than
activation checkpointing, which runs the head twice).

Precision (`head_matmul_dtype`). fp32 hidden states on CPU run exactly as they always did (fp32
matmuls; a bf16 head is upcast per call); on a GPU against a half-precision head (`engine.precision:
fp32` with the bf16 target head) each chunk of hidden states is rounded to the head's dtype instead,
so the head is never copied to fp32. bf16/fp16 hidden states (the GPU engine) keep the head in its own dtype: the
matmuls run on tensor cores with fp32 accumulation and fp32 output (`torch.mm(..., out_dtype=)`
on CUDA; a half-precision product upcast elsewhere), the log-softmax and the loss are fp32 per
chunk, and the softmax - target matrix is rounded to the head's dtype only to multiply it back.
No fp32 copy of the [V, H] head is made. Under torch.autocast (`engine.precision: bf16-mixed`:
fp32 weights) the hidden states are cast to the autocast dtype and take that same path, with
autocast off inside it.

Chunk size (`logits_chunk: auto`, `auto_logits_chunk`): a chunk holds about 10 bytes per logit
(fp32 logits and log-probabilities, then the half-precision softmax), so on a GPU the chunk is
the largest multiple of 256 positions whose logits fit in 2 GiB (1280 positions for a 151936
vocabulary, 4352 for 49152): large enough that each matmul runs at tensor-core speed, small next
to the drafter's activations. On CPU it stays 1024.

Epilogue (`objective.head`): what each chunk's fp32 logits become (loss, argmax, the softmax in the
matmul dtype) is `head_epilogue.ce` / `head_epilogue.kl`, eager on CPU and compiled into fused kernels
on a CUDA GPU, where those passes over [n, V] are most of the head's memory traffic.

Losses: `ce` on the labels, or `kl` to the target's top-k next-token distribution (stored with
the features, renormalised over the ids the draft vocabulary has: `topk_soft_targets`); both
share the chunking and the closed-form gradient (softmax * sum(p) - p for kl).

Loss sums are weighted (w_k, anchors.slot_weights) and left unnormalised; the caller divides by
the sum of weights over the global batch. Statistics stay on the device of the loss; only
`BlockStats.summary` reads them back (at log time).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from dflash_train.model import row_buckets
from dflash_train.train import head_epilogue
from dflash_train.train.anchors import IGNORE

_CHUNK_BYTES = 2 << 30  # GPU budget for one chunk's logits and their softmax
_KEPT_BYTES = 256 << 20  # reweight with a trained head: the most every chunk's dL/dlogits may take together


def auto_logits_chunk(vocab: int, device: torch.device | str) -> int:
    """Positions per LM-head chunk: 1024 on CPU; on a GPU as many as fit in 2 GiB at 10 bytes per logit."""
    if torch.device(device).type != "cuda":
        return 1024
    return int(min(8192, max(256, _CHUNK_BYTES // (10 * vocab) // 256 * 256)))


_FP32_OUT = {"cuda": True}  # torch.mm(..., out_dtype=) is CUDA-only (torch >= 2.8); set False if refused


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as fp32: fp32 operands as they are; half-precision operands with fp32 accumulation and output."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda and _FP32_OUT["cuda"]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except torch.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError):  # an older torch: round the output once
            _FP32_OUT["cuda"] = False
    return row_buckets.mm(a, b).float()  # on a CPU, oneDNN's kernels reused across the steps' row counts


def head_matmul_dtype(hidden: torch.dtype, weight: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype the head's matmuls take their operands in (the product is fp32 either way):
    half-precision hidden states keep theirs; fp32 hidden states run fp32 on CPU (exact, as before),
    but on a GPU against a half-precision head (`engine.precision: fp32` with the bf16 target head)
    they are rounded to the head's dtype per chunk, so no fp32 copy of the [V, H] head is made and the
    matmuls run on tensor cores with fp32 accumulation."""
    if hidden != torch.float32:
        return hidden
    if device_type == "cuda" and weight in (torch.bfloat16, torch.float16):
        return weight
    return torch.float32


def _add_head_grad(grad_w: torch.Tensor, d: torch.Tensor, h: torch.Tensor, wt: torch.Tensor,
                   labels: torch.Tensor | None, half: bool) -> None:
    """grad_w += d^T (h * wt) for one chunk, minus the one-hot part of the ce gradient at the labels' rows."""
    hw = h * wt[:, None].to(h.dtype)
    grad_w += _mm(d.t(), hw)
    if labels is not None:
        grad_w.index_add_(0, labels, -hw.float() if half else -hw)


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, target_ids, target_p, chunk, kind, compiled, reweight):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # reweight: every row's weight is also scaled by reweight(p(label) of every row), known only after the
        # last chunk: the rows' losses and input gradients are kept unscaled until then, and a trained head's
        # gradient is taken from the chunks' kept dL/dlogits at the end (head_loss bounds their memory)
        m = hidden.shape[0]
        label_nll = torch.empty(m, dtype=torch.float32, device=hidden.device) if reweight else None
        row_loss = torch.empty(m, dtype=torch.float32, device=hidden.device)
        preds = torch.empty(m, dtype=torch.long, device=hidden.device)
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        kept = []  # reweight with a trained head: (s, e, dL/dlogits) per chunk
        mm_dtype = head_matmul_dtype(hidden.dtype, weight.dtype, hidden.device.type)
        half = mm_dtype != torch.float32
        w = weight.to(mm_dtype)  # no copy when the head already has it (the bf16 target head on a GPU)
        # dL/dlogits is multiplied back in the head's matmul dtype: the softmax is written in it
        grad_dtype = mm_dtype if want_h or want_w else None
        for s in range(0, m, chunk):
            e = min(m, s + chunk)
            h = hidden[s:e].to(mm_dtype)
            logits = _mm(h, w.t())
            wt = weights[s:e].float()
            lab = labels[s:e]
            if reweight is not None and kind != "ce":  # -log p(label): one more pass over the chunk's logits
                label_nll[s:e] = -torch.log_softmax(logits, -1).gather(1, lab[:, None]).squeeze(1)
            if kind == "ce":  # d = softmax; the grad is softmax - onehot, the onehot part taken below
                row_loss[s:e], preds[s:e], d = head_epilogue.ce(logits, lab, grad_dtype, compiled)
                if reweight is not None:  # the row's CE is -log p(label)
                    label_nll[s:e] = row_loss[s:e]
            else:  # soft CE against p over its k ids, plus sum p log p (no grad): KL(p || q); see head_loss
                row_loss[s:e], preds[s:e], d = head_epilogue.kl(logits, target_ids[s:e], target_p[s:e].float(),
                                                               grad_dtype, compiled)
            del logits
            if d is None:
                continue
            # the weights scale rows: apply them to the [n, H] products, not to the [n, V] matrix
            if want_h:
                g = _mm(d, w)
                if kind == "ce":
                    g -= w[lab].float() if half else w[lab]
                grad_h[s:e] = g * wt[:, None]
            if want_w and reweight is not None:
                kept.append((s, e, d))
            elif want_w:
                _add_head_grad(grad_w, d, h, wt, lab if kind == "ce" else None, half)
            del d
        if reweight is not None:
            factor = reweight(torch.exp(-label_nll))
            weights = weights.float() * factor
            if grad_h is not None:
                grad_h *= factor[:, None]
            for s, e, d in kept:
                _add_head_grad(grad_w, d, hidden[s:e].to(mm_dtype), weights[s:e], labels[s:e] if kind == "ce" else None,
                               half)
        total = (weights.float() * row_loss).sum()
        ctx.save_for_backward(grad_h if grad_h is not None else torch.empty(0),
                              grad_w if grad_w is not None else torch.empty(0))
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(preds)
        return total, preds

    @staticmethod
    def backward(ctx, g_total, _g_preds):
        grad_h, grad_w = ctx.saved_tensors
        gh = (grad_h * g_total).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        gw = (grad_w * g_total).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None, None, None, None


def head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
              kind: str = "ce", target: tuple[torch.Tensor, torch.Tensor] | None = None,
              chunk: int | None = 1024, compiled: bool = False,
              reweight: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted loss sum over M positions and the argmax predictions [M].

    hidden [M, H] post-norm; weight [V, H] LM head; labels [M] (draft ids); weights [M].
    kind="kl": `target` = (ids [M, k] long draft ids, p [M, k]) the teacher's distribution over k
    ids (`topk_soft_targets`; p sums to 1 per row, entries with p = 0 are ignored). The loss is the
    soft cross-entropy -sum_j p_j log q(ids_j) plus sum_j p_j log p_j: exactly KL(p || q) with p
    zero outside its k ids, so it is >= 0 and its gradient is the soft cross-entropy's (the
    entropy term is a constant). With k = V and p the full softmax it is the full-vocabulary KL.
    compiled: each chunk's softmax, loss and argmax run as fused compiled kernels (head_epilogue).
    reweight: [M] probabilities of the labels -> [M] factors on `weights`, applied (without a gradient through
    them) once every chunk is done: the same head pass, no second one. A trained head keeps every chunk's
    dL/dlogits until then; when those would pass `_KEPT_BYTES`, the probabilities take a pass of their own first.
    """
    if kind not in ("ce", "kl"):
        raise ValueError(f"loss {kind!r}: choose ce or kl")
    if kind == "kl" and target is None:
        raise ValueError("loss kl needs the target's top-k ids and probabilities")
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0, torch.zeros(0, dtype=torch.long, device=hidden.device)
    chunk = hidden.shape[0] if not chunk else int(chunk)
    if reweight is not None and weight.requires_grad and torch.is_grad_enabled() \
            and hidden.shape[0] * weight.shape[0] * weight.element_size() > _KEPT_BYTES:
        probs = label_probs(hidden, weight, labels, chunk)
        return head_loss(hidden, weight, labels, weights * reweight(probs), kind, target, chunk, compiled)
    ids, p = target if target is not None else (None, None)
    device = hidden.device.type
    # (a meta-device dry run has no autocast at all)
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    if autocast:  # bf16-mixed: the head is the half-precision path, run as written
        hidden = hidden.to(torch.get_autocast_dtype(device))
    with torch.autocast(device, enabled=False) if autocast else nullcontext():
        return _FusedHeadLoss.apply(hidden, weight, labels, weights, ids, p, chunk, kind, compiled, reweight)


@torch.no_grad()
def label_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int | None = 1024) -> torch.Tensor:
    """[M] fp32: the head's probability of each label (no gradient), as `head_loss` computes it (its chunks,
    its matmul dtype, under autocast too): the probabilities its `reweight` receives."""
    seen = []
    head_loss(hidden.detach(), weight.detach(), labels, torch.ones(hidden.shape[0], device=hidden.device),
              chunk=chunk, reweight=lambda probs: seen.append(probs) or torch.ones_like(probs))
    return seen[0] if seen else torch.zeros(0, dtype=torch.float32, device=hidden.device)


def accepted_prefix_weights(probs: torch.Tensor, index: torch.Tensor, shape: tuple[int, int],
                            smoothing: float = 0.0) -> torch.Tensor:
    """[M]: for each labelled slot (flat positions `index` of [N, B] blocks), the product of `probs` over
    the labelled slots before it in its block, i.e. the drafter's own chance (no gradient) that greedy
    verification reaches that slot. Slots without a label pass (slot 0: the anchor, which is always kept).
    smoothing a: each probability is taken as (1 - a) p + a, which keeps early in training the later slots'
    weights off zero."""
    blocks = _smoothed_blocks(probs, index, shape, smoothing)
    exclusive = torch.cat([torch.ones_like(blocks[:, :1]), torch.cumprod(blocks, dim=1)[:, :-1]], dim=1)
    return exclusive.flatten().index_select(0, index)


def expected_length_weights(probs: torch.Tensor, index: torch.Tensor, shape: tuple[int, int],
                            smoothing: float = 0.5) -> torch.Tensor:
    """[M]: the derivative of the block's expected accepted length, sum_j prod_{i<=j} p_i over its labelled
    slots, with respect to log p_k: sum over the labelled slots j >= k of prod_{i<=j} p_i (no gradient). A
    slot counts for every later slot it lets verification reach, not only for itself. With smoothing 0.5
    this is D-PACE (SpecForge's `dpace` loss); `smoothing` as in `accepted_prefix_weights`."""
    blocks = _smoothed_blocks(probs, index, shape, smoothing)
    labelled = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=probs.device)
    labelled[index] = 1.0
    reach = torch.cumprod(blocks, dim=1) * labelled.view(shape)
    to_end = reach.flip(1).cumsum(1).flip(1)
    return to_end.flatten().index_select(0, index)


def _smoothed_blocks(probs: torch.Tensor, index: torch.Tensor, shape: tuple[int, int], smoothing: float) -> torch.Tensor:
    full = torch.ones(shape[0] * shape[1], dtype=torch.float32, device=probs.device)
    full[index] = (1.0 - smoothing) * probs.float() + smoothing
    return full.view(shape)


def topk_soft_targets(draft_ids: torch.Tensor, logp: torch.Tensor, labels: torch.Tensor,
                      temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kl loss's teacher per position: (ids [M, k] long, p [M, k] fp32, scored [M] bool).

    draft_ids [M, k]: the target's top-k ids mapped to draft ids, negative where the draft vocab
    lacks the id (a reduced vocabulary); logp [M, k] their target log-probabilities; labels [M]
    draft ids (negative: outside the draft vocab). p is the target's distribution renormalised
    over the ids the draft vocab has (a softmax of their log-probs, divided by `temperature` first:
    `objective.kl_temperature`); a position with none of them
    falls back to its label (p = 1 there), and `scored` is False where that label is missing too.
    No host reads (torch.where only), so a GPU step never waits here.
    """
    keep = draft_ids >= 0
    fallback = ~keep.any(-1, keepdim=True)  # [M, 1]
    first = torch.zeros_like(keep)
    first[:, 0] = True
    use_label = fallback & first
    keep = torch.where(fallback, first, keep)
    ids = torch.where(use_label, labels[:, None], draft_ids)
    lp = torch.where(use_label, torch.zeros((), dtype=torch.float32, device=logp.device), logp.float() / temperature)
    p = torch.softmax(lp.masked_fill(~keep, float("-inf")), -1)
    scored = (ids[:, 0] >= 0) | ~fallback[:, 0]
    return torch.where(keep, ids, 0).clamp(min=0).long(), p, scored


def reference_head_loss(hidden, weight, labels, weights, kind="ce", target=None):
    """The naive version (all logits at once, plain autograd): the test and bench reference."""
    logits = hidden.float() @ weight.float().t()
    logp = torch.log_softmax(logits, -1)
    if kind == "ce":
        per = F.nll_loss(logp, labels, reduction="none")
    else:
        ids, p = target[0], target[1].float()
        per = (torch.xlogy(p, p) - p * logp.gather(1, ids)).sum(-1)
    return (weights.float() * per).sum(), logits.argmax(-1)


@dataclass
class BlockStats:
    """Sums that aggregate over micro-batches and ranks (all tensors on one device, all_reduce-able).

    They stay where the loss was computed: `add` and `all_reduce` never read a value back to the
    host; `summary` does, once, at log time.

    Two acceptance lengths. `accept_len` weights every block by its `block_weight`: the number of
    its document's anchor candidates over the number of blocks sampled there, so each document counts
    by its positions, as a block at every position would (the check) and as serving does;
    `accept_len_per_block` counts every sampled block once, which favours short documents whenever
    the step samples a fixed number per document (docs/training.md, "Reading the metrics")."""

    loss_sum: torch.Tensor  # weighted loss sum
    weight_sum: torch.Tensor
    correct: torch.Tensor  # [B] per-slot correct counts
    valid: torch.Tensor  # [B] per-slot counts of positions with a label
    accept_sum: torch.Tensor  # sum over blocks of 1 + leading correct slots
    blocks: torch.Tensor  # number of blocks
    accept_weighted: torch.Tensor  # sum over blocks of block_weight * (1 + leading correct slots)
    block_weight: torch.Tensor  # sum of block weights (the candidates the sampled blocks stand for)

    @classmethod
    def zeros(cls, block_size: int, device: torch.device | str | None = None) -> BlockStats:
        z = torch.zeros((), dtype=torch.float64, device=device)
        return cls(z.clone(), z.clone(), torch.zeros(block_size, dtype=torch.float64, device=device),
                   torch.zeros(block_size, dtype=torch.float64, device=device), z.clone(), z.clone(),
                   z.clone(), z.clone())

    def add(self, other: BlockStats) -> BlockStats:
        for f in fields(self):
            mine = getattr(self, f.name)
            setattr(self, f.name, mine + getattr(other, f.name).detach().double().to(mine.device))
        return self

    def all_reduce(self) -> BlockStats:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flat = torch.cat([getattr(self, f.name).reshape(-1) for f in fields(self)])
            dist.all_reduce(flat)
            i = 0
            for f in fields(self):
                t = getattr(self, f.name)
                setattr(self, f.name, flat[i:i + t.numel()].reshape(t.shape))
                i += t.numel()
        return self

    def summary(self) -> dict:
        """loss (normalised), per-slot accuracy (slots 1..B-1), the per-position acceptance length and the
        per-block one (a host read)."""
        acc = (self.correct / self.valid.clamp(min=1))[1:]
        return {"loss": float(self.loss_sum / self.weight_sum.clamp(min=1e-12)),
                "acc": [round(float(a), 6) for a in acc],
                "accept_len": float(self.accept_weighted / self.block_weight.clamp(min=1e-12)),
                "accept_len_per_block": float(self.accept_sum / self.blocks.clamp(min=1)),
                "positions": int(self.valid.sum())}


def slot_correct(labels: torch.Tensor, preds: torch.Tensor) -> torch.Tensor:
    """[N, B] bool: the slot has a label and its prediction equals it. labels [N, B] (IGNORE = no
    label), preds [M] for the labelled slots in row-major order."""
    valid = labels != IGNORE
    correct = torch.zeros_like(valid)
    correct[valid] = preds == labels[valid]
    return correct


def accept_lengths(correct: torch.Tensor) -> torch.Tensor:
    """[N] block acceptance lengths: 1 + the leading slots (from slot 1) predicted right. This is
    what greedy verification commits for a block when the labels are the target's greedy tokens."""
    return 1 + torch.cumprod(correct[:, 1:].long(), dim=1).sum(1)


def block_stats(loss_sum: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, preds: torch.Tensor,
                index: torch.Tensor | None = None, block_weight: torch.Tensor | None = None) -> BlockStats:
    """Stats of N blocks: labels [N, B] (IGNORE = no loss), weights [N, B], preds [M] for the
    valid positions in row-major order; `index` [M]: their flat positions (computed on the host,
    so nothing here waits for the device; found here when not given); `block_weight` [N]: what each
    block stands for in the per-position acceptance length (BlockStats; default 1 each)."""
    valid = labels != IGNORE
    if index is None:
        index = valid.flatten().nonzero().squeeze(1)
    correct = torch.zeros(valid.numel(), dtype=torch.bool, device=labels.device)
    correct[index] = preds == labels.flatten()[index]
    correct = correct.view(valid.shape)
    blocks = torch.full((), labels.shape[0], dtype=torch.float64, device=labels.device)
    lengths = accept_lengths(correct).double()
    bw = blocks.new_ones(labels.shape[0]) if block_weight is None else block_weight.double()
    return BlockStats(loss_sum=loss_sum.detach().double(), weight_sum=weights.flatten()[index].sum().double(),
                      correct=correct.sum(0).double(), valid=valid.sum(0).double(),
                      accept_sum=lengths.sum(), blocks=blocks,
                      accept_weighted=(bw * lengths).sum(), block_weight=bw.sum())
