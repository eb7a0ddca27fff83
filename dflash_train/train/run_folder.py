"""The run folder a training run writes: may it be written, resumed, or is it already done.

Checked before any heavy work (the target is not loaded yet): `--output` follows the output policy
(dflash_train.outputs) and holds this run or nothing, `--resume` has a checkpoint to resume from
and is not past the recipe's last step, and the disk has room for every checkpoint the run keeps.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_train.errors import CheckpointError, ConfigError
from dflash_train.train import checkpointing as ckpt
from dflash_train.train.recipe import RUN_IDENTITY, ResolvedRecipe, TrainRecipe, load_recipe

RESUME_MODES = ("must", "auto")  # --resume: a checkpoint must exist / resume one if it exists, else start


def check_output(output: Path, resolved: ResolvedRecipe, resume: str | None, sources: list) -> None:
    """Before any heavy work: the run folder may be written (dflash_train.outputs), it holds no other
    run and no foreign files, and --resume has something to resume (or is `auto`)."""
    from dflash_train.outputs import plan_output

    cfg_file = output / "resolved_config.yaml"
    is_run = cfg_file.is_file()
    # a folder holding a run is this command's own; anything else non-empty is refused, --resume or not
    plan_output(output, "--output", sources=sources, own=is_run, overwrite=None)
    if not is_run:
        if resume == "must":
            raise ConfigError(f"--resume: {output} holds no training run to resume; run without --resume to start "
                              "one, or pass --resume auto (resume when there is a checkpoint, else start)")
        return
    diff = differs(output, resolved)
    if diff:
        raise ConfigError(f"--output {output}: holds a different run ({diff}); choose a new --output "
                          "(nothing was overwritten)")
    if resume is None:
        raise ConfigError(f"--output {output}: holds a run already; pass --resume to continue it or choose a new "
                          "--output (nothing was overwritten)")
    whole, damaged = ckpt.usable_checkpoints(output)
    if whole:
        step = int(whole[0].name[5:])
        limit = resolved.recipe.optim.max_steps
        if limit is not None and step > limit:
            raise ConfigError(past_the_end(output, step, limit))
        return
    if damaged:
        folder, why = damaged[0]
        raise CheckpointError(f"--resume: every checkpoint in {output / 'checkpoints'} is damaged ({folder.name}: "
                              f"{why}); move that folder away and start over, or choose a new --output")
    if resume == "must":
        raise ConfigError(f"--resume: {output} has no checkpoint to resume from; pass --resume auto to start this "
                          "run over in it, or choose a new --output")


def first_difference(old, new, path: str = "") -> str | None:
    """"its `a.b` is <the run's value>, this recipe's <value>" for the first leaf where two config trees
    differ (`old`: the run's), else None."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*old, *(k for k in new if k not in old)]:
            found = first_difference(old.get(key), new.get(key), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    return None if old == new else f"its `{path}` is {old!r}, this recipe's {new!r}"


def differs(output: Path, resolved: ResolvedRecipe, sections: tuple[str, ...] = RUN_IDENTITY) -> str | None:
    """How the run in `output` (its resolved_config.yaml) differs from `resolved` in `sections`, else None."""
    old = load_recipe(output / "resolved_config.yaml").recipe.model_dump(mode="json")
    new = resolved.recipe.model_dump(mode="json")
    return first_difference({k: old[k] for k in sections}, {k: new[k] for k in sections})


def trained_otherwise(output: Path, config: Path, overrides: list[str]) -> str | None:
    """Why the run in `output` is not the one `config` with `overrides` trains on this machine (a field that
    decides the drafter, optim included, differs), for a pipeline (the demo, a sweep) that trains it again;
    None when it is, or when `output` holds no run."""
    from dflash_train.train.auto_dtypes import resolve_auto_dtypes
    from dflash_train.train.init_from import resolve_init_from

    if not (output / "resolved_config.yaml").is_file():
        return None
    resolved = resolve_auto_dtypes(resolve_init_from(load_recipe(config, overrides)))
    try:
        return differs(output, resolved, (*RUN_IDENTITY, "optim"))
    except ConfigError as exc:  # written by a toolkit whose schema had other fields
        return f"its resolved_config.yaml no longer loads: {str(exc).splitlines()[0]}"


def past_the_end(output: Path, step: int, total: int) -> str:
    return (f"--resume: the run in {output} is already at step {step}, past this recipe's last step {total} "
            "(optim.max_steps / --max-steps, or fewer epochs); nothing was changed. Pass a --max-steps above "
            f"{step} to train on, or use {output / 'final'}")


def finished_summary(output: Path, step: int, total: int, notify) -> dict | None:
    """The summary of a run that already ended at `total` (its final/ and summary.json written), else None."""
    summary_file, final = output / "summary.json", output / "final" / "config.json"
    if step != total or not (summary_file.is_file() and final.is_file()):
        return None
    try:
        summary = json.loads(summary_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("steps") != total:
        return None
    notify(f"the run in {output} already finished at step {total}; nothing to do (its drafter: {output / 'final'})")
    return {**summary, "nothing_to_do": True}


def space_needed(drafter, recipe: TrainRecipe) -> int:
    """Bytes the run writes at most: keep_last + 1 checkpoints (fp32 weights and Adam moments in the
    engine file, the drafter in its save dtype) and final/."""
    n = sum(p.numel() for p in drafter.parameters())
    saved = {"float32": 4, "bfloat16": 2, "float16": 2}[recipe.drafter.dtype]
    return n * (4 + 8 + saved) * (recipe.checkpoint.keep_last + 1) + n * saved
