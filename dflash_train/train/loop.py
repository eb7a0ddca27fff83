"""The training run: setup, one step function, one loop, teardown.

A global step is `grad_accum` micro-batches on each of `world` ranks. Micro-batch j of global
step s on rank r is bin `s * G + j * world + r` (G = grad_accum * world) of its epoch's plan, so
1 rank x 2 accumulation steps and 2 ranks x 1 see the same documents. The loss of every
micro-batch is divided by the sum of slot weights over the whole global batch (all ranks, all
accumulation steps; one all_reduce before the forwards), so the update does not depend on how
the batch is split.

The step never waits for the device: micro-batches reach it through pinned memory, statistics and
token counts stay there (summed, all-reduced) and are read back only when they are logged or
saved. An out-of-memory error in a step becomes a ConfigError naming the micro-batch size.
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from dflash_train import compiled
from dflash_train.data.packing import plan_microbatches
from dflash_train.errors import ConfigError
from dflash_train.machine import machine_facts
from dflash_train.train import checkpointing as ckpt
from dflash_train.train import compiled_step
from dflash_train.train.anchors import anchor_candidates
from dflash_train.train.auto_dtypes import dtype_fields, resolve_auto_dtypes
from dflash_train.train.batches import build_microbatch, head_rows, microbatch_loss
from dflash_train.train.build_drafter import build_drafter
from dflash_train.train.device import (
    StepKernels,
    oom_guard,
    resolve_attention,
    return_freed_memory,
    step_kernels,
    trim_host_heap,
)
from dflash_train.train.documents import (
    MEMORY_SHARE,
    DocumentSource,
    fit_rows,
    prepared_rows,
    source_balance,
    training_rows,
    validation_rows,
)
from dflash_train.train.engine import (
    World,
    all_reduce_sum,
    barrier,
    build_engine,
    forward_precision,
    init_distributed,
)
from dflash_train.train.feature_source import recipe_source
from dflash_train.train.finite import FiniteGuard
from dflash_train.train.init_from import resolve_init_from
from dflash_train.train.loss import BlockStats
from dflash_train.train.metrics import GradNormWindow, Laps, Progress, RunLog, plot_curves, write_summary
from dflash_train.train.prefetch import StepPrefetch, worth_prefetching
from dflash_train.train.profiling import StepProfile, profile_lines
from dflash_train.train.recipe import ResolvedRecipe, TrainRecipe
from dflash_train.train.run_folder import RESUME_MODES, check_output, finished_summary, past_the_end, space_needed


class StepPlan:
    """Which prepared rows every (global step, micro-batch, rank) trains on; epochs re-shuffled."""

    def __init__(self, rows: list[int], lengths: list[int], recipe: TrainRecipe, world: int,
                 row_weight: dict[int, float] | None = None):
        self.rows, self.lengths = rows, lengths
        self.row_weight = row_weight  # the step's acceptance length weighs a mixture's sources as the check does
        self.budget, self.seed = recipe.batch.tokens_per_microbatch, recipe.seed
        self.group = recipe.batch.grad_accum * world
        self._bins: dict[int, list[list[int]]] = {}
        if len(self.bins(0)) < self.group:
            raise ConfigError(f"batch: {len(rows)} training rows make {len(self.bins(0))} micro-batches of "
                              f"{self.budget} tokens, fewer than grad_accum x ranks = {self.group}; lower "
                              "batch.tokens_per_microbatch or batch.grad_accum, or add data")
        o = recipe.optim
        full, frac = int(o.epochs), o.epochs - int(o.epochs)
        self.total = sum(self.steps_in(e) for e in range(full)) + int(frac * self.steps_in(full))
        self.total = max(1, self.total) if o.max_steps is None else o.max_steps

    def bins(self, epoch: int) -> list[list[int]]:
        if epoch not in self._bins:
            self._bins[epoch] = plan_microbatches(self.lengths, self.budget, self.seed, epoch)
        return self._bins[epoch]

    def steps_in(self, epoch: int) -> int:
        return len(self.bins(epoch)) // self.group

    def locate(self, step: int) -> tuple[int, int]:
        epoch = 0
        while step >= self.steps_in(epoch):
            step -= self.steps_in(epoch)
            epoch += 1
        return epoch, step

    def rows_for(self, step: int, micro: int, rank: int, world: int) -> tuple[int, list[int]]:
        epoch, s = self.locate(step)
        b = self.bins(epoch)[s * self.group + micro * world + rank]
        return epoch, [self.rows[i] for i in b]


def _microbatch(recipe: TrainRecipe, source: DocumentSource, rows: list[int], epoch: int, device: torch.device,
                every_anchor: bool = False, row_weight: dict[int, float] | None = None):
    """A micro-batch of `rows`: blocks at sampled anchors (`objective.anchors_per_document` or
    `objective.anchor_density`, resampled each epoch), or with `every_anchor` at every candidate position
    (the held-out check)."""
    o = recipe.objective
    docs = source.get(rows)
    return build_microbatch(docs, rows, block_size=recipe.drafter.block_size,
                            anchors_per_document=o.anchors_per_document, labels=o.labels, seed=recipe.seed,
                            anchor_density=o.anchor_density.as_tuple() if o.anchor_density else None,
                            epoch=epoch, gamma=o.gamma, pin_memory=device.type == "cuda",
                            context_pad=recipe.batch.tokens_per_microbatch, row_weight=row_weight,
                            loss_row_weight=row_weight if o.balance_sources else None,
                            feature_noise=None if every_anchor else (o.feature_noise, recipe.drafter.num_features),
                            prompt_from=source.prompt_start() if o.positions == "all" and not every_anchor else None,
                            repeat_weight=None if every_anchor else o.repeat_weight,
                            trained_slots=None if every_anchor else o.trained_slots,
                            anchors=[anchor_candidates(d.loss_mask) for d in docs] if every_anchor else None)


def step_batches(recipe: TrainRecipe, source: DocumentSource, plan: StepPlan, world: World, step: int) -> list:
    """The micro-batches of global step `step` on this rank (host work; run ahead by StepPrefetch)."""
    mbs = []
    for micro in range(recipe.batch.grad_accum):
        epoch, rows = plan.rows_for(step, micro, world.rank, world.size)
        mbs.append(_microbatch(recipe, source, rows, epoch, world.device, row_weight=plan.row_weight))
    return mbs


def train_step(engine, recipe: TrainRecipe, source: DocumentSource, plan: StepPlan, world: World,
               step: int, guard: FiniteGuard, kernels: StepKernels, batches: list | None = None,
               ) -> tuple[BlockStats, torch.Tensor]:
    """One optimizer step on `batches` (built here when not given); returns the global stats and the
    number of tokens the step read, both on the device (read them when logging: reading them here
    would wait for the step to finish)."""
    mbs = batches if batches is not None else step_batches(recipe, source, plan, world, step)
    tokens = sum(mb.packed.input_ids.numel() for mb in mbs)
    global_weight = all_reduce_sum(sum(mb.weight_sum for mb in mbs), world.device).clamp(min=1e-12)
    stats = BlockStats.zeros(recipe.drafter.block_size, world.device)
    o = recipe.objective
    for i, mb in enumerate(mbs):
        with forward_precision(recipe, world.device):
            if kernels.forward == "compiled":
                loss_sum, st = compiled_step.microbatch_loss(
                    engine.module, mb, loss=o.loss, prefix_weighting=o.prefix_weighting,
                    prefix_smoothing=o.prefix_smoothing, kl_temperature=o.kl_temperature)
            else:
                loss_sum, st = microbatch_loss(engine.module, mb, loss=o.loss, attention=kernels.attention,
                                               chunk=kernels.logits_chunk, head=kernels.head,
                                               prefix_weighting=o.prefix_weighting,
                                               prefix_smoothing=o.prefix_smoothing, kl_temperature=o.kl_temperature)
        # DeepSpeed averages gradients over ranks: multiply by world to keep a global sum / global weight
        engine.backward(loss_sum * (world.size / global_weight).to(loss_sum.dtype), scale_wrt_gas=False)
        last = i == len(mbs) - 1
        # the gradients' norm: the optimizer's own where it computes one for the clip (one pass, not two)
        reuse = last and getattr(engine.optimizer, "computes_grad_norm", False)
        guard.observe(step + 1, loss_sum, engine.module if last and not reuse else None)  # on device, no sync
        engine.step()
        if reuse:
            guard.observe_grad_norm(step + 1, engine.optimizer.grad_norm)
        stats.add(st)
    return stats.all_reduce(), all_reduce_sum(tokens, world.device)


def check_plan(recipe: TrainRecipe, source: DocumentSource, rows: list[int], labels: list[str] | None,
               world: World) -> dict[str | None, list[list[int]]]:
    """The periodic check's micro-batches on this rank: per source (None without a mixture), the rows of
    each, packed as training packs them. The same order on every rank, so the all_reduces pair up."""
    groups: dict[str | None, list[int]] = {}
    for i in rows:
        groups.setdefault(labels[i] if labels else None, []).append(i)
    plan = {}
    for label, members in groups.items():
        bins = plan_microbatches([source.lengths[i] for i in members], recipe.batch.tokens_per_microbatch,
                                 recipe.seed, 0)
        plan[label] = [[members[i] for i in b] for b in bins[world.rank::world.size]]
    return plan


@torch.no_grad()
def validate(engine, recipe: TrainRecipe, source: DocumentSource, rows: list[int], labels: list[str] | None,
             world: World, kernels: StepKernels) -> tuple[dict, dict] | None:
    """Loss, accuracy per position and acceptance length on `rows` (held-out rows, or training rows for
    the like-for-like `fit/` numbers) with a block at every position, as `dflash-train eval`'s
    teacher-forced "all", so the numbers do not depend on the recipe's anchor budget; and for a
    mixture each source's acceptance length: ({loss, acc, accept_len, positions}, {accept_len_<source>})."""
    if not rows:
        return None
    total = BlockStats.zeros(recipe.drafter.block_size, world.device)
    by_source = {}
    engine.module.eval()
    for label, bins in check_plan(recipe, source, rows, labels, world).items():
        stats = BlockStats.zeros(recipe.drafter.block_size, world.device)
        for b in bins:
            mb = _microbatch(recipe, source, b, 0, world.device, every_anchor=True)
            with forward_precision(recipe, world.device):
                stats.add(microbatch_loss(engine.module, mb, loss=recipe.objective.loss,
                                          attention=kernels.attention, chunk=kernels.logits_chunk,
                                          head=kernels.head)[1])
        stats.all_reduce()
        total.add(stats)
        if label is not None:
            by_source[f"accept_len_{label}"] = stats.summary()["accept_len"]
    engine.module.train()
    summary = total.summary()
    del summary["accept_len_per_block"]  # one block per position: the same number
    return summary, by_source


def _by_source(entry: dict) -> dict:
    return {k.removeprefix("accept_len_"): v for k, v in entry.items() if k.startswith("accept_len_")}


TRIM_EVERY = 50  # steps between two trims of the C heap on a CPU (train/device.trim_host_heap)


def train(resolved: ResolvedRecipe, output: str | Path, resume: str | bool | None = None, sources=(),
          notify: Callable[[str], None] | None = None) -> dict:
    """Train a drafter as the recipe says; returns the summary written to OUTPUT/summary.json.

    `resume`: None (a new run), "must" (True) or "auto". `sources`: input paths besides the recipe's
    own (the recipe file) that --output must not hold. `notify` gets one-line progress notes
    (resumed from where, damaged checkpoints skipped); by default they are warnings.
    """
    from dflash_train.model.weights import write_json
    from dflash_train.outputs import check_writable, ensure_folder, plan_output
    from dflash_train.target import load_target, resolve_target, target_torch_dtype

    t_start, lap = time.time(), Laps()
    resolved = resolve_init_from(resolved)
    recipe, output = resolved.recipe, Path(output)
    resume = {True: "must", False: None}.get(resume, resume)
    if resume not in (None, *RESUME_MODES):
        raise ConfigError(f"--resume {resume}: use --resume (a checkpoint must exist) or --resume auto")
    notify = notify or (lambda msg: warnings.warn(msg, stacklevel=2))
    d = recipe.data
    sources = [*sources, recipe.target, d.prepared, *d.source_names(), d.feature_cache, recipe.drafter.init_from]
    world = init_distributed()
    resolved = resolve_auto_dtypes(resolved, world.device)  # the dtypes that run here, recorded as such
    recipe = resolved.recipe
    resolve_attention(recipe.objective.attention, world.device)  # refuse flex without CUDA before loading
    check_output(output, resolved, resume, sources)
    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    lap("start")  # the process group (DeepSpeed's, its first import included) and the recipe's checks

    # setup: target, drafter, data, engine -------------------------------------------------
    target_path = resolve_target(recipe.target)
    lap("target_files")  # the embedded target's GGUF converted to a transformers folder on a first run
    target_model, tokenizer = load_target(target_path, dtype=target_torch_dtype(recipe.data.target_dtype, world.device),
                                          device=str(world.device))
    lap("load_target")
    if world.is_main:  # rank 0 prepares and caches; the others then read the cache
        data_path = prepared_rows(recipe.data, target_path)
    barrier()
    data_path = prepared_rows(recipe.data, target_path) if not world.is_main else data_path
    lap("prepare_and_regenerate")
    data = training_rows(recipe.data, data_path)
    rows, train_rows, held, labels = data.rows, data.train, data.held, data.labels
    drafter = build_drafter(recipe, target_path, target_model, tokenizer, data.token_counts, world).to(world.device)
    check_writable(output, "--output", space_needed(drafter, recipe), inside=output.is_dir())
    source = recipe_source(recipe, target_path, data, target_model, drafter)
    plan = StepPlan(train_rows, [source.lengths[i] for i in train_rows], recipe, world.size,
                    source_balance(train_rows, labels))
    val_rows = validation_rows(held, labels, recipe.logging.eval_documents)
    fit_count = recipe.logging.eval_documents if recipe.logging.fit_documents is None else recipe.logging.fit_documents
    check_fit_rows = fit_rows(train_rows, labels, fit_count, recipe.data.seed) if val_rows else []
    home = source.warm(train_rows + val_rows, tokens_per_batch=max(4096, recipe.batch.tokens_per_microbatch),
                       progress=world.is_main and recipe.logging.progress)
    if home is not None and home.type != world.device.type and world.is_main:
        notify(f"data.features: memory keeps the documents in host RAM: at {source.bytes_per_token()} bytes a token "
               f"they take more than {MEMORY_SHARE:.0%} of the GPU's free memory (each step copies its batch over)")
    embed, lm_head = target_model.get_input_embeddings().weight, target_model.get_output_embeddings().weight
    if source.mode != "online":  # the steps read the cache or memory: only the embedding and head stay loaded
        source.release_target()
        del target_model
        return_freed_memory(world.device)
    lap("features")
    drafter.activation_checkpointing = recipe.engine.activation_checkpointing
    drafter.set_dropout(recipe.objective.dropout)
    engine, scheduler = build_engine(drafter, recipe, plan.total)
    engine.module.attach_target_weights(embed, lm_head)  # borrowed, frozen
    kernels = step_kernels(recipe, world.device, head_rows(engine.module))
    kernels = replace(kernels, forward=compiled_step.resolve(recipe.objective.training_forward, engine.module, recipe,
                                                             attention=kernels.attention, device=world.device,
                                                             total_steps=plan.total))
    engine.module.use_fused_ops(kernels.layers == "compiled")

    state = {"step": 0, "tokens": 0, "positions": 0, "history": []}
    if resume and ckpt.step_folders(output):
        state = ckpt.resume_latest(engine, world, output, notify if world.is_main else (lambda msg: None))
        if state["step"] > plan.total:  # nothing written yet: the run folder stays as it was
            raise ConfigError(past_the_end(output, state["step"], plan.total))
        done_before = finished_summary(output, state["step"], plan.total, notify if world.is_main else (lambda msg: None))
        if done_before is not None:
            barrier()
            return done_before if world.is_main else {}
    config_yaml = resolved.to_yaml()
    if world.is_main:
        is_run = (output / "resolved_config.yaml").is_file()
        ensure_folder(plan_output(output, "--output", sources=sources, own=is_run, overwrite=None), "train")
        (output / "resolved_config.yaml").write_text(config_yaml)
        write_json(output / "holdout_rows.json", {"data": str(data_path), "rows": held, "num_rows": len(rows)})
    log = RunLog(output, world.is_main, state["history"])
    progress = Progress(plan.total, state["step"], world.is_main and recipe.logging.progress)

    # counts since the last flush, on the device: read (one host sync) only to log or save
    pending = {"tokens": torch.zeros((), dtype=torch.float64, device=world.device),
               "positions": torch.zeros((), dtype=torch.float64, device=world.device)}

    def flush() -> None:
        for key, value in pending.items():
            state[key] += int(value)
            value.zero_()

    def save(step: int) -> None:
        guard.check_weights(step, engine.module)
        flush()
        snapshot = {"step": step, "world_size": world.size, "tokens": state["tokens"], "positions": state["positions"],
                    "epoch": plan.locate(step)[0] if step < plan.total else None, "history": log.history}
        ckpt.save_checkpoint(engine, world, output, step, snapshot, config_yaml, recipe.checkpoint.keep_last,
                             recipe.drafter.dtype)

    # the loop -------------------------------------------------------------------------------
    window = BlockStats.zeros(recipe.drafter.block_size, world.device)
    norms = GradNormWindow(engine.optimizer, recipe.optim.grad_clip, world.device)
    guard, lg = FiniteGuard(world.device, recipe.optim.lr, recipe.optim.grad_clip), recipe.logging
    t_loop = time.time()
    # on a GPU step s + 1's micro-batches are built on the host while the device runs step s (train/prefetch.py)
    lap("setup")
    prefetch = StepPrefetch(lambda s: step_batches(recipe, source, plan, world, s), plan.total, world.device,
                            enabled=worth_prefetching(world.device, recipe.engine.prefetch))
    profile = StepProfile(lg.profile_steps, state["step"] + lg.profile_from, plan.total, world.device,
                          output if world.is_main else None)
    try:
        for step in range(state["step"], plan.total):
            profile.begin(step)
            with oom_guard(recipe, world.device):
                stats, tokens = train_step(engine, recipe, source, plan, world, step, guard, kernels,
                                           batches=prefetch.get(step))
            if profile.end(step):
                progress.note(profile_lines(profile.summary))
            if step + 1 == plan.total or any((step + 1) % n == 0 for n in (lg.log_every, lg.eval_every,
                                                                            recipe.checkpoint.save_every)):
                guard.check()  # read once before anything is logged, validated or saved from this step
            pending["tokens"] += tokens
            pending["positions"] += stats.valid.sum()
            window.add(stats)
            norms.add()
            done = step + 1
            progress.step()
            if done % TRIM_EVERY == 0 and world.device.type == "cpu":
                trim_host_heap()  # the step's freed buffers back to the system (a third of the run's growth)
            if done % recipe.logging.log_every == 0 or done == plan.total:
                flush()
                summary, lr = window.summary(), scheduler.get_last_lr()[0]
                progress.show(summary, lr, state["positions"], fit=log.last("fit"), val=log.last("val"))
                log.record(done, "train", summary, {"lr": lr, "tokens": state["tokens"],
                                                    "time_s": round(time.time() - t_loop, 3), **norms.read()})
                window = BlockStats.zeros(recipe.drafter.block_size, world.device)
            if done % recipe.logging.eval_every == 0 or done == plan.total:
                with oom_guard(recipe, world.device), lap.aside("checks"):
                    val = validate(engine, recipe, source, val_rows, labels, world, kernels)
                    fit = validate(engine, recipe, source, check_fit_rows, labels, world, kernels)
                if val is not None:
                    log.record(done, "val", *val)
                if fit is not None:
                    log.record(done, "fit", *fit)
            if done % recipe.checkpoint.save_every == 0 or done == plan.total:
                with lap.aside("checkpoints"):
                    save(done)
    finally:
        prefetch.close()  # also when a step fails: no build left running
    progress.close()

    lap("steps")
    # teardown: final drafter, curves, summary -------------------------------------------------
    guard.check()
    guard.check_weights(plan.total, engine.module)
    final = ckpt.save_final(engine, world, output, recipe.drafter.dtype)
    summary = {}
    if world.is_main:
        train_last, val_last, fit_last = log.last("train"), log.last("val"), log.last("fit")
        summary = {
            "target": str(recipe.target or target_path), "data": str(data_path),
            "data_source": recipe.data.prepared or ", ".join(recipe.data.source_names()),
            "steps": plan.total, "tokens": state["tokens"], "trained_positions": state["positions"],
            "train_loss": train_last and train_last["loss"], "val_loss": val_last and val_last["loss"],
            "train_acc_per_position": train_last and train_last["acc"],
            "val_acc_per_position": val_last and val_last["acc"],
            # per position (blocks weighted by their document's candidates over its sampled blocks), and per
            # sampled block (what earlier runs logged as train accept_len; it favours short documents)
            "train_accept_len": train_last and train_last["accept_len"],
            "train_accept_len_per_block": train_last and train_last.get("accept_len_per_block"),
            "val_accept_len": val_last and val_last["accept_len"],
            "val_accept_len_by_source": val_last and _by_source(val_last),
            # the same check on training rows: held-out acceptance well below it is data, not the drafter
            "fit_loss": fit_last and fit_last["loss"], "fit_accept_len": fit_last and fit_last["accept_len"],
            "fit_accept_len_by_source": fit_last and _by_source(fit_last),
            "holdout_rows": len(held), "train_rows": len(train_rows), "world_size": world.size,
            # what ran: attention, the LM head's epilogue, the layers' fused ops, any compiled part that fell back
            "kernels": {"attention": kernels.attention, "head": kernels.head, "layers": kernels.layers,
                        "forward": kernels.forward,
                        "logits_chunk": kernels.logits_chunk, "fallbacks": dict(compiled.fallbacks)},
            # the dtypes that ran and the layer that set each (`auto: this CPU has avx512_bf16`)
            "dtypes": dtype_fields(resolved),
            "wall_time_s": round(time.time() - t_start, 2), "stage_seconds": lap.final(),
            "memory_high_water_gib": lap.memory,  # RAM: the process's resident peak as each lap closed
            # where and when the seconds above were measured (a sweep that reuses this run says so beside them)
            "machine": machine_facts(), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "final": str(final), "eval": None, "profile": profile.summary,  # logging.profile_steps
        }
        write_summary(output / "summary.json", summary)
        plot_curves(log.history, output / "curves.png")
    log.close()
    barrier()
    return summary
