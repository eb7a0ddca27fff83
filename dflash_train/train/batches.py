"""Documents -> one packed micro-batch -> anchors, labels, layout -> the weighted loss.

Anchors are sampled per document (a per-row budget would starve short documents): a fixed count
each, or a fraction of each document's candidates (`anchor_density`), with a generator fixed by
(seed, epoch, prepared row) so a resumed run samples the same anchors. Every block carries the
number of candidates of its document over the number sampled there (`block_weight`), so the step's
acceptance length weighs each document by its positions as the check and serving do.

Host and device. Everything that decides *which* positions train (anchors, labelled slots,
weights, the layout) is built on the host; values that come from the target (greedy labels,
features of online runs) stay on the device they were computed on. `microbatch_loss` moves host
tensors to the model's device through pinned memory and indexes with host-computed indices, so
a step never waits on the GPU to learn a shape.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dflash_train.data.packing import Document, PackedBatch, pack_documents, to_device
from dflash_train.data.repeats import repeat_anchors
from dflash_train.model.modeling_dflash import DFlashDraftModel
from dflash_train.model.train_layout import TrainLayout, train_layout
from dflash_train.train.anchors import (
    IGNORE,
    anchor_budget,
    anchor_candidates,
    anchor_generator,
    anchor_seed,
    block_labels,
    labelled_slots,
    sample_anchors,
    slot_weights,
    with_prompt_positions,
)
from dflash_train.train.loss import (
    BlockStats,
    accepted_prefix_weights,
    block_stats,
    expected_length_weights,
    head_loss,
    topk_soft_targets,
)


@dataclass
class MicroBatch:
    packed: PackedBatch
    anchors: torch.Tensor  # [N] indices into the packed row
    labels: torch.Tensor  # [N, B] target ids, IGNORE where no loss (on the greedy tokens' device)
    weights: torch.Tensor  # [N, B] slot weight where labelled, else 0 (host)
    layout: TrainLayout  # host
    # kl: the target's top-k (target ids [M, k] int32, log-probs [M, k]) at the labelled slots, row-major,
    # on the device the top-k were stored on
    target_topk: tuple[torch.Tensor, torch.Tensor] | None = None
    valid: torch.Tensor | None = None  # [N, B] bool, host: the slots that carry a label
    # [N] float, host: candidates of the block's document / blocks placed there (1 for given anchors)
    block_weight: torch.Tensor | None = None
    # slots 1..trained_slots alone carry labels, and the drafter's last layer computes those alone (None: all)
    trained_slots: int | None = None

    def __post_init__(self):
        if self.valid is None:
            self.valid = (self.labels != IGNORE).cpu()
        if self.block_weight is None:
            self.block_weight = torch.ones(self.anchors.numel())

    @property
    def weight_sum(self) -> float:
        return float(self.weights.sum())  # a host tensor: no device read


def add_feature_noise(features: torch.Tensor, layers: int, scale: float, generator: torch.Generator) -> torch.Tensor:
    """`features` [T, layers * H] plus U(-scale, scale) times each layer's RMS at each token: EAGLE's noise
    on the target's hidden states, in each layer's own scale (deep layers' states are far larger)."""
    x = features.float().view(features.shape[0], layers, -1)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.rand(x.shape, generator=generator, device=x.device).mul_(2).sub_(1).mul_(rms * scale)
    return (x + noise).view_as(features).to(features.dtype)


def build_microbatch(docs: list[Document], rows: list[int], *, block_size: int, anchors_per_document: int,
                     labels: str, seed: int, epoch: int, gamma: float | None = None,
                     anchors: list[torch.Tensor] | None = None, pin_memory: bool = False,
                     anchor_density: tuple[float, int, int | None] | None = None,
                     context_pad: int | None = None, row_weight: dict[int, float] | None = None,
                     loss_row_weight: dict[int, float] | None = None,
                     feature_noise: tuple[float, int] | None = None,
                     prompt_from: int | None = None, repeat_weight: float | None = None,
                     trained_slots: int | None = None) -> MicroBatch:
    """Pack `docs` (prepared rows `rows`) and lay out their blocks.

    Documents that carry the target's top-k (kl loss) give the micro-batch the top-k of the
    position whose prediction each labelled slot is (the label's source position).
    anchors: per document, sorted in-document positions to place blocks at instead of sampling
    them (eval places them where decode steps began); labels follow the same rules either way.
    anchor_density: (fraction, floor, cap) of each document's candidates to sample instead of
    `anchors_per_document` (anchors.anchor_budget).
    pin_memory: host features are packed into pinned memory (for a non-blocking copy to a GPU).
    context_pad: the run's micro-batch token budget; compiled flex pads every context to it (one shape).
    row_weight: per prepared row, a factor on its sampled blocks' `block_weight` (a mixture's sources
    weighed as the check weighs them: documents.source_balance); the loss is unchanged.
    loss_row_weight: per prepared row, a factor on its blocks' slot weights, i.e. on the loss
    (`objective.balance_sources`: every source of a mixture counts as much in the loss).
    feature_noise: (scale, feature layers): `add_feature_noise` on the packed features, seeded by (seed,
    epoch, first row), so a resumed run sees the same noise (`objective.feature_noise`).
    prompt_from: also train every prompt position from this one on (`objective.positions: all`; the rows'
    shared template prefix, anchors.shared_prefix_length), on the target's greedy labels (with `labels` dataset,
    the answers' slots keep the dataset's tokens: anchors.with_prompt_positions).
    repeat_weight: a factor on the slot weights of blocks whose anchor repeats earlier text of its document
    (data/repeats.py; `objective.repeat_weight`).
    trained_slots: only slots 1..trained_slots of each block carry a label (`objective.trained_slots`); the
    blocks keep every slot, as served.
    """
    if trained_slots is not None and trained_slots >= block_size - 1:
        trained_slots = None  # every predicted slot
    if prompt_from is not None:  # dataset labels keep the answers' tokens and take the target's on the prompts
        docs = [with_prompt_positions(d, prompt_from, answers_from_dataset=labels == "dataset") for d in docs]
        labels = "greedy"
    packed = pack_documents(docs, pin_memory=pin_memory)
    if feature_noise and feature_noise[0] > 0 and rows:
        g = torch.Generator(device=packed.features.device).manual_seed(anchor_seed(seed + 1, epoch, rows[0]))
        packed.features = add_feature_noise(packed.features, feature_noise[1], feature_noise[0], g)
        if pin_memory and packed.features.device.type == "cpu":  # features on a GPU (online, memory) stay there
            packed.features = packed.features.pin_memory()
    starts = [0]
    for d in docs[:-1]:
        starts.append(starts[-1] + len(d))
    if anchors is None:
        anchors, doc_weight = [], []
        for d, row in zip(docs, rows, strict=False):
            n = int(anchor_candidates(d.loss_mask).numel())
            a = sample_anchors(d.loss_mask, anchor_budget(n, anchors_per_document, anchor_density),
                               anchor_generator(seed, epoch, row))
            anchors.append(a)
            doc_weight.append(n / max(1, a.numel()) * (row_weight[row] if row_weight else 1.0))
    else:  # given positions count once each
        doc_weight = [1.0] * len(anchors)
    block_weight = torch.cat([torch.full((a.numel(),), w, dtype=torch.float32)
                              for a, w in zip(anchors, doc_weight, strict=True)]) if anchors else torch.zeros(0)
    in_doc = anchors  # per document, its own positions
    per_doc = [a.long() + s for a, s in zip(in_doc, starts, strict=True)]
    anchors = torch.cat(per_doc) if per_doc else torch.zeros(0, dtype=torch.long)
    lab, src = block_labels(anchors, packed.input_ids, packed.loss_mask, packed.greedy_next,
                            packed.doc_end[anchors], block_size, labels, trained_slots)
    valid, _ = labelled_slots(anchors, packed.loss_mask, packed.doc_end[anchors], block_size, trained_slots)
    weights = slot_weights(block_size, gamma)[None, :].expand_as(valid) * valid
    if loss_row_weight:
        per_block = [torch.full((a.numel(),), loss_row_weight[row]) for a, row in zip(per_doc, rows, strict=True)]
        weights = weights * torch.cat(per_block)[:, None]
    if repeat_weight is not None and repeat_weight != 1.0:
        flags = torch.cat([repeat_anchors(d.input_ids.tolist(), a.tolist(), block_size)[0]
                           for d, a in zip(docs, in_doc, strict=True)])
        weights = weights * torch.where(flags, repeat_weight, 1.0)[:, None]
    layout = train_layout(anchors, packed.doc_start[anchors], packed.positions, block_size, ctx_pad=context_pad)
    target_topk = None
    if packed.target_topk_ids is not None:
        at = src[valid]  # host tensors: the gather index is known without reading the device
        target_topk = (packed.target_topk_ids[to_device(at, packed.target_topk_ids.device)],
                       packed.target_topk_logp[to_device(at, packed.target_topk_logp.device)])
    return MicroBatch(packed, anchors, lab, weights, layout, target_topk, valid, block_weight, trained_slots)


def predicted_rows(index: torch.Tensor, width: int, depth: int) -> torch.Tensor:
    """Flat positions `index` of labelled slots in [N, width] -> their rows in the drafter's [N, depth] predicted
    slots (slot 0 never predicted; depth B - 1, or `MicroBatch.trained_slots`): block n, slot k -> n depth + k - 1."""
    return index // width * depth + index % width - 1


def head_weight(model: DFlashDraftModel) -> torch.Tensor:
    """The LM head the drafter scores with: its own (reduced vocab) or the target's, frozen. Under
    ZeRO-3 a reduced head is a partition outside a module call: score with `full_head_weight`."""
    if model.lm_head is not None:
        return model.lm_head.weight
    if model._target_lm_head is None:
        raise RuntimeError("call attach_target(target_model) before training")
    return model._target_lm_head


def head_rows(model: DFlashDraftModel) -> int:
    """Rows of the LM head (the draft vocabulary), also when ZeRO-3 holds only a partition of it."""
    w = head_weight(model)
    return int(w.ds_shape[0]) if hasattr(w, "ds_shape") else int(w.shape[0])


@contextmanager
def full_head_weight(model: DFlashDraftModel):
    """The whole LM head for the duration. ZeRO-3 partitions the reduced head like every parameter
    and gathers a module's parameters only around its own call; the fused head reads the weight
    directly, so it is gathered here (an all-gather of draft_vocab x hidden, released on exit; the
    fused head needs it only in its forward, which also computes its gradient). A trainable head
    under ZeRO-3 is refused by the recipe: its gradient would land on the gathered copy."""
    w = head_weight(model)
    if not hasattr(w, "ds_id"):
        yield w
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters([w], modifier_rank=None):
        yield w


def microbatch_loss(model: DFlashDraftModel, mb: MicroBatch, *, loss: str = "ce", attention: str = "split",
                    chunk: int | None = 1024, head: str = "eager",
                    prefix_weighting: bool | str = False, prefix_smoothing: float | None = None,
                    kl_temperature: float = 1.0) -> tuple[torch.Tensor, BlockStats]:
    """Unnormalised weighted loss sum of one micro-batch (differentiable) and its stats, both on the
    model's device; nothing is read back to the host. head: eager | compiled (the LM head's per-chunk
    epilogue, train/head_epilogue.py); prefix_weighting, prefix_smoothing, kl_temperature: see
    `microbatch_predictions`."""
    device = model.fc.weight.device
    if mb.anchors.numel() == 0:  # no supervised pair in these documents: a zero that still has a graph
        zero = sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
        return zero, BlockStats.zeros(model.config.block_size, device)
    index = to_device(mb.valid.flatten().nonzero().squeeze(1), device)  # host nonzero: no device sync
    loss_sum, preds = microbatch_predictions(model, mb, index, loss=loss, attention=attention, chunk=chunk,
                                             head=head, prefix_weighting=prefix_weighting,
                                             prefix_smoothing=prefix_smoothing, kl_temperature=kl_temperature)
    return loss_sum, block_stats(loss_sum, to_device(mb.labels, device), to_device(mb.weights, device), preds, index,
                                 to_device(mb.block_weight, device))


def slot_targets(model: DFlashDraftModel, mb: MicroBatch, index: torch.Tensor, *, loss: str,
                 kl_temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
    """What the labelled slots (flat positions `index` of [N, B], on the model's device) are scored against:
    (labels [M] as draft ids, IGNORE where a reduced vocabulary lacks them; slot weights [M]; scored [M] bool;
    kl: the teacher (ids [M, k], p [M, k]) of `topk_soft_targets`, else None)."""
    device = index.device
    labels = model.target_to_draft(to_device(mb.labels, device).flatten().index_select(0, index))
    keep = labels != IGNORE  # reduced vocab: labels outside it cannot be scored
    w = to_device(mb.weights, device).flatten().index_select(0, index)
    target = None
    if loss == "kl":
        if mb.target_topk is None:
            raise ValueError("loss kl needs documents with the target's top-k (DocumentSource(topk=k))")
        ids, logp = (to_device(t, device) for t in mb.target_topk)
        # kl scores a slot whose label the reduced vocab lacks when some of its top-k ids are in it
        tids, p, keep = topk_soft_targets(model.target_to_draft(ids.long()), logp, labels, kl_temperature)
        target = (tids, p)
    return labels, w, keep, target


def microbatch_predictions(model: DFlashDraftModel, mb: MicroBatch, index: torch.Tensor | None = None, *,
                           loss: str = "ce", attention: str = "split",
                           chunk: int | None = 1024, head: str = "eager",
                           prefix_weighting: bool | str = False, prefix_smoothing: float | None = None,
                           kl_temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The training forward of a micro-batch with at least one anchor: (weighted loss sum, the
    drafter's argmax as target ids [M] at the labelled slots, row-major, on the model's device).
    Blocks are as wide as `mb.labels` (at most the drafter's block size). `index` [M]: the flat
    positions of the labelled slots (found on the host when not given). prefix_weighting
    (`objective.prefix_weighting`): each slot's weight is also scaled by the drafter's own chance (no
    gradient) that the slots before it in its block are all right, the chance serving reaches it; taken in
    the head's own pass (`loss.head_loss(reweight=)`); "expected_length": by the derivative of the block's
    expected accepted length (`loss.expected_length_weights`, D-PACE). prefix_smoothing: the probabilities'
    smoothing (`objective.prefix_smoothing`; None: 0 for prefix weighting, 0.5 for expected_length).
    kl_temperature (`objective.kl_temperature`): the kl teacher's log-probs are divided by it before they are
    renormalised (`loss.topk_soft_targets`)."""
    device = model.fc.weight.device
    if index is None:
        index = to_device(mb.valid.flatten().nonzero().squeeze(1), device)
    first = mb.packed.input_ids[mb.anchors]
    embeds = model.embed(to_device(model.block_ids(first)[:, : mb.labels.shape[1]], device))
    layout = mb.layout.to(device)
    # slot 0 (the anchor's given token) is never labelled: the drafter skips its outputs, [N, D, H] for the
    # D = B - 1 predicted slots (or the first `mb.trained_slots` of them)
    hidden = model.forward_train(to_device(mb.packed.features, device), embeds, layout, attention=attention,
                                 anchor_slot=False, trained_slots=mb.trained_slots)
    width = mb.labels.shape[1]
    labels, w, keep, target = slot_targets(model, mb, index, loss=loss, kl_temperature=kl_temperature)
    with full_head_weight(model) as weight:
        rows = hidden.flatten(0, 1).index_select(0, predicted_rows(index, width, hidden.shape[1]))
        reweight = None
        if prefix_weighting:  # a label outside a reduced vocabulary is never drafted: probability 0
            shape = tuple(mb.labels.shape)
            weigh = expected_length_weights if prefix_weighting == "expected_length" else accepted_prefix_weights
            smoothing = {} if prefix_smoothing is None else {"smoothing": prefix_smoothing}  # None: weigh's default

            def reweight(probs):
                return weigh(probs * keep, index, shape, **smoothing)
        loss_sum, preds = head_loss(rows, weight, labels.clamp(min=0), w * keep, kind=loss, target=target,
                                    chunk=chunk, compiled=head == "compiled", reweight=reweight)
    return loss_sum, model.draft_to_target(preds)
