"""The training forward and its backward as one compiled graph (`objective.training_forward: compiled`).

Eager, a step of the CPU demo is ~5,600 operators around a few matmuls: on 2 AMX cores the forward and backward
took ~140 ms of a ~176 ms step, of which the matmuls were ~50 (a profile of 20 steps, 2026-12-05). Inductor fuses
the rest into a few C++ loops, but it specialises a graph on every host number it meets, and a run's micro-batches
change size every step: compiling `batches.microbatch_loss` as it is built a new graph for nearly every
micro-batch (~35 s each on 2 cores; docs/results/2026-12-05-drafter-quality-round-26.md). This path hands the
graph only tensors whose sizes it may keep symbolic:

- split attention's grid of runs is built on the host beforehand, every run padded to the layout's
  `chunk_blocks` blocks and at least two runs (a size of 1 would be specialised), and the attention takes it
  as it is (`TrainLayout.grid`), without choosing between the grid and the runs one by one;
- the head scores every predicted slot of every block, the slots without a label (or whose label a reduced
  vocabulary lacks) weighted 0, instead of the labelled slots a host index picks: a plain [N, B - 1, V] product
  whose gradient autograd takes (no chunk loop; on a CPU the whole micro-batch's logits are a few MB);
- the packed tokens and the blocks are padded to `row_buckets.rows` on the host (`padded_layout`), so that the
  graph's half-precision matmuls meet a few shapes (oneDNN builds a kernel per shape, inside a graph as outside),
  and row bucketing is off inside the graph (`row_buckets.compiles_per_shape`), whose padding would pin a size.

So one graph serves a run's micro-batches (the packed tokens, the blocks, the runs and their span symbolic), but for
the size thresholds of Inductor's C++ code: a float sum over more than 4,096 elements takes a chunked accumulator, so
a gradient summed over blocks x heads (the RMSNorm weights') splits the graph where the block count crosses 4,096 /
(slots x heads). In the CPU demo: 152 blocks (96% of the micro-batches above, the rest and an epoch's last below)
and 342 (a few above), each second graph ~20 s of compiles on 2 cores. While they stay rare, a micro-batch below
such a threshold that the first graph lies above is padded up across it, and one above runs eager (`GraphSides`).
The loss, its gradient and the argmax are those of the eager step (`batches.microbatch_predictions`:
tests/unit/train/test_compiled_step.py); the statistics are then
taken eager from the argmax at the labelled slots. What this path does not take (`ineligible`) runs eager.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from dflash_train import compiled
from dflash_train.data.packing import to_device
from dflash_train.errors import ConfigError
from dflash_train.model import row_buckets
from dflash_train.model.modeling_dflash import DFlashDraftModel
from dflash_train.model.train_layout import TrainLayout, train_layout
from dflash_train.train import batches
from dflash_train.train.head_epilogue import EXP_FLOOR
from dflash_train.train.loss import BlockStats, block_stats

KNOB = "objective.training_forward compiled"
CPP_SUM_CHUNK = 4096  # Inductor's C++ float sums over more elements take a chunked accumulator (a guard on the size)
MIN_RUNS = 2  # the grid's runs are padded to at least this many: a dimension of size 1 is specialised
AUTO_MIN_STEPS = 1000  # `auto` compiles runs of this many steps or more


def ineligible(model: DFlashDraftModel, *, attention: str, prefix_weighting: bool | str, zero_stage: int) -> str | None:
    """Why this drafter and objective keep the eager forward (None: the compiled one can run them)."""
    if attention != "split":
        return f"objective.attention is {attention} (the compiled forward runs split attention's grid)"
    if prefix_weighting not in (False, True):
        return f"objective.prefix_weighting is {prefix_weighting} (the compiled forward weighs by the accepted prefix)"
    if zero_stage == 3:
        return "engine.zero_stage is 3 (its parameter gathers run inside every module call)"
    if model.activation_checkpointing:
        return "engine.activation_checkpointing is on"
    if len({layer.self_attn.window for layer in model.layers}) > 1:
        return "the drafter mixes sliding-window and full attention layers (one grid serves every layer)"
    return None


def resolve(choice: str, model: DFlashDraftModel, recipe, *, attention: str, device: torch.device | str,
            total_steps: int, amx: bool | None = None) -> str:
    """`objective.training_forward` for this run: eager or compiled. auto: compiled where it was measured faster, a
    bf16-mixed step on a CPU with AMX (`machine.cpu_amx`, or `amx`), for runs of at least `AUTO_MIN_STEPS` steps
    that it can take (`ineligible`); eager elsewhere: an fp32 step (no faster compiled on AVX2: 290 against 293 ms,
    with ~80 s of compiles), a CPU with AVX512-BF16 but no AMX (0.92x the step on Zen 4 once compiled, but ~77 s of
    compiles that the demo's 2,000 steps do not pay back on a first run), a GPU (unmeasured), and short runs (tests,
    smoke runs), whose steps would not pay back the compiles. `compiled` where it cannot run is refused.
    attention: the resolved `objective.attention`."""
    why = ineligible(model, attention=attention, prefix_weighting=recipe.objective.prefix_weighting,
                     zero_stage=recipe.engine.zero_stage)
    if choice == "compiled" and why:
        raise ConfigError(f"objective.training_forward: compiled cannot run this recipe: {why}; "
                          "set objective.training_forward: eager (or auto)")
    if choice != "auto":
        return choice
    if torch.device(device).type != "cpu" or recipe.engine.precision != "bf16-mixed" or why \
            or total_steps < AUTO_MIN_STEPS:
        return "eager"
    from dflash_train.machine import cpu_amx

    return "compiled" if (cpu_amx() if amx is None else amx) else "eager"


def forward_loss(model: DFlashDraftModel, features: torch.Tensor, block_ids: torch.Tensor, layout,
                 labels: torch.Tensor, weights: torch.Tensor, labelled: torch.Tensor, keep: torch.Tensor,
                 target_ids: torch.Tensor | None, target_p: torch.Tensor | None, kind: str, prefix_weighting: bool,
                 smoothing: float, trained_slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted loss sum, argmax draft ids [N, D]) of blocks `block_ids` [N, B] over `features` [T, F].

    Per predicted slot (slots 1..D of every block, D = B - 1 or `trained_slots`): labels [N, D] draft ids (0 where
    none), weights the slot's loss weight (0 where it has no label or the label is not scored), labelled: whether it
    carries a label, keep: whether its label can be drafted. kl: target_ids / target_p [N, D, k], the teacher (`topk_soft_targets`;
    p = 0 where unlabelled). prefix_weighting: each slot's weight times the drafter's own chance (no gradient)
    that the labelled slots before it in its block are right, as `loss.accepted_prefix_weights` with `smoothing`:
    a label the vocabulary lacks is never drafted (0), a slot without a label passes (1)."""
    hidden = model.forward_train(features, model.embed(block_ids), layout, attention="split", anchor_slot=False,
                                 trained_slots=trained_slots)
    logits = model.logits(hidden).float()
    logp = torch.log_softmax(logits, -1)
    if kind == "kl":
        row = (torch.xlogy(target_p, target_p) - target_p * logp.gather(-1, target_ids)).sum(-1)
    else:
        row = -logp.gather(-1, labels[..., None]).squeeze(-1)
    if prefix_weighting:
        p = logp.detach().gather(-1, labels[..., None]).squeeze(-1).clamp(min=EXP_FLOOR).exp() * keep
        passes = torch.where(labelled, (1.0 - smoothing) * p + smoothing, 1.0)
        reach = torch.cat([torch.ones_like(passes[:, :1]), torch.cumprod(passes, dim=1)[:, :-1]], dim=1)
        weights = weights * reach
    return (weights * row).sum(), logits.argmax(-1)


def _symbolic(layout) -> None:
    """Mark the sizes that change from micro-batch to micro-batch as such before the first compile, so the first
    graph is already the general one (the packed tokens, the blocks, the grid's runs and span)."""
    for t, dims in ((layout.ctx_positions, (0,)), (layout.block_positions, (0,)), (layout.grid.rows, (0,)),
                    (layout.grid.ctx_index, (0, 1)), (layout.grid.ctx_ok, (0, 3))):
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)


def padded_layout(layout: TrainLayout, features: torch.Tensor, blocks: int,
                  window: int | None) -> tuple[TrainLayout, torch.Tensor]:
    """(`layout` with `blocks` blocks and its grid, the features) padded for the graph: the packed tokens to
    `row_buckets.rows` (zero features, never attended), blocks appended up to `blocks` that may attend to no
    context (anchored at 0: nothing lies before it; their slots weigh nothing), and the grid of runs built with
    every run `chunk_blocks` long, at least `MIN_RUNS` runs, its runs and span rounded up as row buckets round
    them. So the matmuls and batched matmuls of the graph meet a few shapes in a run: on a CPU, oneDNN builds a
    kernel for every new shape of a half-precision matmul, inside a graph as outside (model/row_buckets.py)."""
    t, extra = layout.ctx_positions.numel(), blocks - layout.anchors.numel()
    pad_t = row_buckets.rows(t) - t
    padded = train_layout(torch.cat([layout.anchors, layout.anchors.new_zeros(extra)]),
                          torch.cat([layout.doc_start, layout.doc_start.new_zeros(extra)]),
                          F.pad(layout.ctx_positions, (0, pad_t)), layout.block_positions.shape[1],
                          chunk_blocks=layout.chunk_blocks, ctx_pad=layout.ctx_pad)
    padded.grid = padded.padded_runs(window, bucket=True, per_run=layout.chunk_blocks, min_runs=MIN_RUNS)
    return padded, F.pad(features, (0, 0, 0, pad_t))


def block_thresholds(model: DFlashDraftModel, width: int, depth: int) -> list[int]:
    """Block counts at which a sum over blocks x (a slot and head count of the layers) crosses `CPP_SUM_CHUNK`: the
    RMSNorm weights' gradients sum over every query slot and head (q_norm), every key slot and kv head (k_norm), every
    slot (the layer norms). Each is a size at which Inductor's C++ graph is specialised on one side."""
    attn = model.layers[0].self_attn
    per_block = {s * h for s in (width, depth) for h in (1, attn.num_heads, attn.num_kv_heads)}
    return sorted({CPP_SUM_CHUNK // m + 1 for m in per_block})


class GraphSides:
    """Which side of each threshold (`block_thresholds`) the compiled graphs of one drafter were made for, and what a
    micro-batch on another side does instead of compiling a graph of its own (~20 s on 2 cores, ~200 of the demo's
    steps): one below the first graph's count is padded up to it (`blocks`); one above runs `forward_loss` eager. Both
    only while such micro-batches stay rare (at most `OFF_SHARE` of those seen, and 2 more): where they are common,
    a graph for their side pays for itself, and the next one compiles it."""

    OFF_SHARE = 0.1

    def __init__(self, thresholds: list[int]):
        self.thresholds, self.first, self.sides = thresholds, None, set()
        self.seen = self.off = 0

    def side(self, blocks: int) -> tuple[bool, ...]:
        return tuple(blocks >= t for t in self.thresholds)

    def blocks(self, n: int) -> tuple[int, bool]:
        """(the blocks a micro-batch of `n` is padded to, whether it runs compiled)."""
        n_pad = row_buckets.rows(n)
        side = self.side(n_pad)
        self.first = n_pad if self.first is None else self.first
        self.seen += 1
        if not self.sides or side in self.sides or self.off >= self.OFF_SHARE * self.seen + 2:  # (common: compile it)
            self.sides.add(side)
            return n_pad, True
        self.off += 1
        if n_pad < self.first:  # up across the thresholds between it and the first graph: its side, never more blocks
            return row_buckets.rows(max(t for t in self.thresholds if n_pad < t <= self.first)), True
        return n_pad, False


_sides: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its GraphSides


def microbatch_loss(model: DFlashDraftModel, mb, *, loss: str = "ce", prefix_weighting: bool = False,
                    prefix_smoothing: float | None = None, kl_temperature: float = 1.0,
                    compile: bool = True) -> tuple[torch.Tensor, BlockStats]:
    """`batches.microbatch_loss` through `forward_loss`, compiled (`compile=False`: the same maths eager, the
    reference the tests hold the graph to). The micro-batch's host tensors are laid out per predicted slot here."""
    device = model.fc.weight.device
    n, width = mb.labels.shape
    if n == 0:  # no supervised pair: the eager step's zero with a graph
        return batches.microbatch_loss(model, mb)
    host_index = mb.valid.flatten().nonzero().squeeze(1)  # the labelled slots' flat positions in [N, width]
    index = to_device(host_index, device)
    depth = width - 1 if mb.trained_slots is None else mb.trained_slots  # the predicted slots the graph computes
    n_pad = row_buckets.rows(n)  # blocks added (weight 0) so that the matmuls meet a few row counts
    if compile and device.type == "cpu":  # and the few sides of Inductor's C++ thresholds already compiled
        if model not in _sides:  # built once: setdefault would rebuild its argument every micro-batch
            _sides[model] = GraphSides(block_thresholds(model, width, depth))
        n_pad, compile = _sides[model].blocks(n)
    slots = n_pad * depth
    slot_rows = to_device(batches.predicted_rows(host_index, width, depth), device)  # in [N, depth]
    labels_m, w_m, keep_m, target = batches.slot_targets(model, mb, index, loss=loss, kl_temperature=kl_temperature)
    w_m = w_m * keep_m
    target_ids = target_p = None
    if target is not None:
        tids, p = target
        k = tids.shape[1]
        target_ids = tids.new_zeros(slots, k).index_copy(0, slot_rows, tids).view(n_pad, depth, k)
        target_p = p.new_zeros(slots, k).index_copy(0, slot_rows, p).view(n_pad, depth, k)

    def per_slot(values: torch.Tensor, fill=0) -> torch.Tensor:
        return torch.full((slots,), fill, dtype=values.dtype, device=device).index_copy(0, slot_rows, values).view(
            n_pad, depth)

    labels = per_slot(labels_m.clamp(min=0))
    weights, labelled, keep = per_slot(w_m.float()), per_slot(torch.ones_like(keep_m), False), per_slot(keep_m, False)
    layout, features = padded_layout(mb.layout, mb.packed.features, n_pad, model.layers[0].self_attn.window)
    layout = layout.to(device)  # the layout itself on a CPU
    block_ids = model.block_ids(torch.cat([mb.packed.input_ids[mb.anchors], mb.anchors.new_zeros(n_pad - n)]))
    args = (model, to_device(features, device), to_device(block_ids[:, :width], device), layout, labels,
            weights, labelled, keep, target_ids, target_p, loss, bool(prefix_weighting), float(prefix_smoothing or 0.0),
            mb.trained_slots)
    if compile:
        _symbolic(layout)
        dims = {1: [0], 2: [0], 4: [0], 5: [0], 6: [0], 7: [0]} | ({8: [0], 9: [0]} if loss == "kl" else {})
        loss_sum, preds = compiled.call("training forward", forward_loss, args, dims, KNOB, detach=False)
    else:
        loss_sum, preds = forward_loss(*args)
    preds_m = model.draft_to_target(preds.flatten().index_select(0, slot_rows))  # the labelled slots' argmax, row-major
    return loss_sum, block_stats(loss_sum, to_device(mb.labels, device), to_device(mb.weights, device), preds_m,
                                 index, to_device(mb.block_weight, device))

