"""Anchors, block labels and slot weights (training.md, "Anchors and blocks" and "Loss").

An anchor a is a position with loss_mask[a] and loss_mask[a+1] set inside one document. Its
block is `[x_a, MASK x (B-1)]` at positions a..a+B-1; slot k (k >= 1) is trained on the token
at a+k: the target's greedy token there (`greedy_next[a+k-1]`) or the dataset token
(`input_ids[a+k]`). Slot 0, positions past the document end and positions outside the loss
mask carry no loss (label -100).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

IGNORE = -100

# gamma of the paper for its block sizes; other sizes interpolate linearly between these
# points and extrapolate with the slope of the nearest segment (never below 1)
_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


def gamma_for_block_size(block_size: int) -> float:
    """Decay gamma of w_k = exp(-(k-1)/gamma): 4 for B=8, 5 for B=10, 7 for B=16.

    Other block sizes: piecewise-linear through those three points, extended with the slope of
    the end segments (B=4 -> 2.0, B=12 -> 5.67, B=32 -> 12.33), floored at 1.
    """
    pts = _GAMMA_POINTS
    if block_size <= pts[1][0]:
        (b0, g0), (b1, g1) = pts[0], pts[1]
    else:
        (b0, g0), (b1, g1) = pts[1], pts[2]
    gamma = g0 + (block_size - b0) * (g1 - g0) / (b1 - b0)
    return max(1.0, gamma)


def slot_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[B] weights: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    gamma = gamma or gamma_for_block_size(block_size)
    w = torch.tensor([0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block_size)])
    return w


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a of one document with loss_mask[a] and loss_mask[a+1] set."""
    m = loss_mask.bool()
    if m.numel() < 2:
        return torch.zeros(0, dtype=torch.long)
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def shared_prefix_length(rows: list[list[int]]) -> int:
    """Tokens every row starts with (the chat template's system prompt and header), at least 1."""
    if not rows:
        return 1
    first, n = rows[0], min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != first[i] for r in rows):
            return max(1, i)
    return max(1, n)


def with_prompt_positions(doc, start: int, answers_from_dataset: bool = False):
    """`doc` with its loss mask widened to every position from `start` on (`objective.positions: all`):
    the prompt's tokens after the shared template prefix become anchors and labelled slots too. Their
    labels must be the target's greedy tokens (what it would say there), never the user's text.

    `answers_from_dataset` (`objective.labels: dataset`): the greedy column is rewritten so that a slot on an
    answer's token reads that token and one on the prompt the target's argmax; greedy labels then give both.
    The argmax is needed only where the next token is outside the loss mask: a feature cache written with
    `greedy="prompts"` holds it there alone (-1 at the others)."""
    mask = doc.loss_mask.clone()
    mask[start:] = True
    if not answers_from_dataset:
        return replace(doc, loss_mask=mask)
    greedy = doc.greedy_next
    if greedy is None:
        raise ValueError("prompt positions train on the target's greedy tokens: these documents hold none")
    answer = doc.loss_mask[1:].bool().to(greedy.device)
    merged = greedy.clone()
    merged[:-1] = torch.where(answer, doc.input_ids[1:].to(greedy.device), greedy[:-1])
    if bool((merged[max(0, start - 1): -1] < 0).any()):
        raise ValueError("prompt positions train on the target's greedy tokens, and these documents miss one at a "
                         "prompt's position (a feature cache written without them)")
    return replace(doc, loss_mask=mask, greedy_next=merged)


def anchor_budget(candidates: int, per_document: int, density: tuple[float, int, int | None] | None = None) -> int:
    """Blocks to sample in a document with `candidates` anchor candidates: `per_document`, or with
    `density` = (fraction, floor, cap) ceil(fraction * candidates) clamped to [floor, cap] (cap None: no
    cap). Never more than the candidates (sampling is without replacement)."""
    if density is None:
        budget = per_document
    else:
        fraction, floor, cap = density
        budget = max(floor, math.ceil(fraction * candidates - 1e-9))
        if cap is not None:
            budget = min(budget, cap)
    return min(budget, candidates)


def sample_anchors(loss_mask: torch.Tensor, budget: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `budget` candidate anchors of one document, without replacement, sorted."""
    cand = anchor_candidates(loss_mask)
    if cand.numel() > budget:
        pick = torch.randperm(cand.numel(), generator=generator)[:budget]
        cand = cand[pick]
    return torch.sort(cand).values


def anchor_seed(seed: int, epoch: int, row: int) -> int:
    """A seed determined by (seed, epoch, prepared row): resampled every epoch, resumable."""
    return (seed * 1_000_003 + epoch) * 10_000_019 + row


def anchor_generator(seed: int, epoch: int, row: int) -> torch.Generator:
    """A CPU generator seeded by `anchor_seed`."""
    return torch.Generator().manual_seed(anchor_seed(seed, epoch, row))


def labelled_slots(anchors: torch.Tensor, loss_mask: torch.Tensor, doc_end: torch.Tensor,
                   block_size: int, trained_slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid [N, B]: slot k of block n carries a label, position a+k [N, B] clamped into the row).
    Host tensors: which slots are labelled never depends on label values. trained_slots D: slots past D carry
    none (`objective.trained_slots`)."""
    k = torch.arange(block_size)
    pos = anchors[:, None] + k  # a + k
    valid = (k[None, :] >= 1) & (pos < doc_end[:, None])
    if trained_slots is not None:
        valid &= k[None, :] <= trained_slots
    safe = pos.clamp(max=loss_mask.numel() - 1)
    valid &= loss_mask.bool()[safe]
    return valid, safe


def block_labels(anchors: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 greedy_next: torch.Tensor | None, doc_end: torch.Tensor, block_size: int,
                 labels: str = "greedy", trained_slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels [N, B] (IGNORE where no loss) and source positions [N, B] (a+k-1, the position whose
    target prediction is the label; used to gather target logits for KL).

    anchors index a packed row; doc_end[n] is one past the last token of anchor n's document.
    Greedy labels stay on the device of `greedy_next` (online features on a GPU): they are
    gathered there, never copied back to the host.
    """
    from dflash_train.data.packing import to_device

    valid, safe = labelled_slots(anchors, loss_mask, doc_end, block_size, trained_slots)
    src = (safe - 1).clamp(min=0)
    if labels == "greedy":
        if greedy_next is None:
            raise ValueError("labels: greedy needs the target's greedy tokens")
        lab = greedy_next[to_device(src, greedy_next.device)]
    elif labels == "dataset":
        lab = input_ids[safe]
    else:
        raise ValueError(f"labels {labels!r}: choose greedy or dataset")
    lab = torch.where(to_device(valid, lab.device), lab, torch.full_like(lab, IGNORE))
    return lab, src
