"""Documents and packed training rows.

Features are computed per document (online or from the offline cache) and then packed into
one row per micro-batch, keeping document ids, in-document positions and document starts so
that anchors, masks and labels never cross documents.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class Document:
    """One prepared conversation with its target features.

    greedy_next[t] is the target's argmax at position t, i.e. its prediction for token t+1; the
    top-k pair (kl loss only) is aligned the same way: the target's k most likely next tokens at
    t and their log-probabilities over the full vocabulary, largest first.
    """

    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] bool
    features: torch.Tensor  # [T, n_aux * H_target]
    greedy_next: torch.Tensor  # [T] long
    target_topk_ids: torch.Tensor | None = None  # [T, k] int32
    target_topk_logp: torch.Tensor | None = None  # [T, k] bf16 or fp32

    def __len__(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class PackedBatch:
    """Several documents concatenated into one row of T tokens."""

    input_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T] bool
    features: torch.Tensor  # [T, n_aux * H_target]
    greedy_next: torch.Tensor  # [T]
    doc_ids: torch.Tensor  # [T] 0..D-1
    positions: torch.Tensor  # [T] position inside its document
    doc_start: torch.Tensor  # [T] packed index of the first token of its document
    doc_end: torch.Tensor  # [T] packed index one past the last token of its document
    target_topk_ids: torch.Tensor | None = None  # [T, k] when every document has them
    target_topk_logp: torch.Tensor | None = None  # [T, k]

    @property
    def num_documents(self) -> int:
        return int(self.doc_ids.max().item()) + 1 if self.doc_ids.numel() else 0


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`. Host tensors bound for a GPU go through pinned memory with non_blocking, so the
    copy is queued behind the GPU's work instead of waiting for it (a copy from pageable memory can
    stall the host until the stream drains)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
    return t.to(device)


def pack_documents(docs: list[Document], pin_memory: bool = False) -> PackedBatch:
    """Concatenate documents into one row; `pin_memory`: host features land in pinned memory (one
    copy, ready for a non-blocking transfer to the GPU)."""
    if not docs:
        raise ValueError("pack_documents needs at least one document")
    lengths = [len(d) for d in docs]
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    doc_ids = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    doc_start = starts[doc_ids]
    doc_end = doc_start + torch.tensor(lengths)[doc_ids]
    feats = [d.features for d in docs]
    out = None
    if pin_memory and feats[0].device.type == "cpu" and torch.cuda.is_available():
        out = torch.empty((sum(lengths), *feats[0].shape[1:]), dtype=feats[0].dtype, pin_memory=True)
    return PackedBatch(
        input_ids=torch.cat([d.input_ids.long() for d in docs]),
        loss_mask=torch.cat([d.loss_mask.bool() for d in docs]),
        features=torch.cat(feats, out=out),
        greedy_next=torch.cat([d.greedy_next.long() for d in docs]),
        doc_ids=doc_ids, positions=positions, doc_start=doc_start, doc_end=doc_end,
        target_topk_ids=_cat_optional([d.target_topk_ids for d in docs]),
        target_topk_logp=_cat_optional([d.target_topk_logp for d in docs]),
    )


def _cat_optional(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The concatenation when every document has the tensor, else None (documents of one source
    either all carry top-k or none do; a mix with other k fails in torch.cat)."""
    return None if any(p is None for p in parts) else torch.cat(parts)


def plan_microbatches(lengths: list[int], token_budget: int, seed: int, epoch: int) -> list[list[int]]:
    """Group document indices into micro-batches of at most `token_budget` tokens.

    Deterministic in (seed, epoch): documents are shuffled, then filled first-fit into bins.
    A document longer than the budget gets a bin of its own (callers truncate at prepare).
    """
    order = list(range(len(lengths)))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(token_budget - n)
    return bins


# One more padded forward is worth it where it saves this share of the rows' own tokens in padding (a GPU's
# kernel launches may price it higher: train/documents.launch_tokens). On the shipped ShareGPT first exchanges
# packed first-fit into 3,072 tokens: one padded forward computes 1.97x the rows' tokens, these groups 1.10x in
# 2.5 forwards (8,192 tokens: 3.04x against 1.21x in 3.2; docs/results/2026-12-07-round-39-online-groups-heads.md).
EXTRA_CALL_SHARE = 0.125


def padded_groups(lengths: list[int], extra_call_tokens: float | None = None) -> list[list[int]]:
    """The indices of `lengths` split into right-padded batches, longest first, that cost the fewest padded
    tokens plus `extra_call_tokens` for each batch (default: `EXTRA_CALL_SHARE` of their sum). One padded
    batch of a micro-batch's documents, whose lengths often differ tenfold, pads each one to the longest;
    exact over the length-sorted order (a batch of sorted lengths pads to its first)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    call = EXTRA_CALL_SHARE * sum(lengths) if extra_call_tokens is None else float(extra_call_tokens)
    n = len(order)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):  # best[j]: the first j sorted rows, in batches; cut[j]: where its last batch starts
        for i in range(j):
            cost = best[i] + (j - i) * lengths[order[i]] + call
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]
