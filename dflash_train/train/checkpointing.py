"""Checkpoints that resume exactly, written atomically.

OUTPUT/checkpoints/step-000050/
    config.json, model.safetensors      the servable drafter (speculators format)
    trainer_state/engine/...            DeepSpeed: module, optimizer (per ZeRO partition), scheduler
    trainer_state/state.json            step, data position, metric history
    trainer_state/rng-rank{r}.pt        python / torch RNG states of every rank
    trainer_state/resolved_config.yaml
Everything is written into `.tmp-step-000050` and renamed when every rank is done, so a
folder named `step-*` is always complete; a crash leaves only a `.tmp-*` folder, which the
next save removes. The last `keep_last` checkpoints are kept.

A disk can still damage a finished one (a truncated engine file, an unreadable state.json, a
missing shard): `checkpoint_problem` finds that from the files alone, and resuming falls back
to the newest checkpoint that is whole, naming every damaged one it skips.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from dflash_train.errors import CheckpointError, OutputError
from dflash_train.model.checkpoint import save_drafter
from dflash_train.model.weights import tensor_shapes, write_json
from dflash_train.outputs import install_folder, is_disk_full, no_room
from dflash_train.train.engine import World, all_reduce_sum, barrier, gathered_params

STATE = "trainer_state"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(output: Path) -> list[Path]:
    root = Path(output) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step-*") if (p / STATE / "state.json").is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def step_folders(output: Path) -> list[Path]:
    """Every `checkpoints/step-N` folder, whole or not, oldest first."""
    root = Path(output) / "checkpoints"
    found = [p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name[5:]))


def _torch_file_problem(path: Path, folder: Path) -> str | None:
    """torch.save files are zip archives: a cut one has no central directory or short members."""
    rel = path.relative_to(folder)
    if not path.is_file():
        return f"{rel} is missing"
    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as z:
            if any(i.header_offset + i.compress_size > size for i in z.infolist()):
                return f"{rel} is truncated"
    except (OSError, zipfile.BadZipFile) as exc:
        return f"{rel} is truncated or not a torch file ({exc})"
    return None


def checkpoint_problem(folder: Path) -> str | None:
    """Why `folder` cannot be resumed from, judged from its files alone (cheap: headers only), or None."""
    folder = Path(folder)
    state_file = folder / STATE / "state.json"
    try:
        state = json.loads(state_file.read_text())
    except OSError:
        return f"{STATE}/state.json is missing"
    except ValueError as exc:
        return f"{STATE}/state.json is unreadable ({exc})"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return f"{STATE}/state.json holds no step"
    try:
        json.loads((folder / "config.json").read_text())
        tensor_shapes(folder)  # every listed weight file present, every header whole
    except (OSError, ValueError, CheckpointError) as exc:
        return f"drafter files damaged ({exc})"
    engine = folder / STATE / "engine"
    files = sorted(engine.glob("*model_states.pt"))
    if not files:
        return f"{STATE}/engine holds no model states"
    ranks = int(state.get("world_size") or 1)
    optim = sorted(engine.glob("*optim_states.pt"))
    if optim:  # ZeRO: one optimizer shard per rank
        missing = [r for r in range(ranks) if not any(f"zero_pp_rank_{r}_" in p.name for p in optim)]
        if missing:
            return f"{STATE}/engine lacks the optimizer shard of rank(s) {missing}"
    files += optim + [folder / STATE / f"rng-rank{r}.pt" for r in range(ranks)]
    for f in files:
        problem = _torch_file_problem(f, folder)
        if problem:
            return problem
    return None


def usable_checkpoints(output: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """(whole checkpoints newest first, [(damaged checkpoint, why)] newest first)."""
    whole, damaged = [], []
    for folder in reversed(step_folders(output)):
        problem = checkpoint_problem(folder)
        if problem:
            damaged.append((folder, problem))
        else:
            whole.append(folder)
    return whole, damaged


def resume_latest(engine, world: World, output: Path, notify: Callable[[str], None]) -> dict:
    """Load the newest whole checkpoint; a damaged newer one is skipped with a warning naming it."""
    for folder in reversed(step_folders(output)):
        problem = checkpoint_problem(folder)
        if problem is None:
            try:
                state = load_checkpoint(engine, world, folder)
                failed = 0.0
            except CheckpointError as exc:
                state, failed, problem = None, 1.0, str(exc)
            if all_reduce_sum(failed) == 0:  # every rank loaded it
                notify(f"resuming from {folder} (step {state['step']})")
                return state
            problem = problem or "another rank could not load it"
        notify(f"warning: checkpoint {folder} is damaged ({problem}); falling back to the one before it")
    raise CheckpointError(f"--resume: no usable checkpoint in {Path(output) / 'checkpoints'} (all damaged, see the "
                          "warnings above); move that folder away and start over, or choose a new --output")


def checkpoint_bytes(module, save_dtype: str) -> int:
    """What one checkpoint takes on disk, at most: the engine's weights and fp32 master copy (4 + 4
    bytes), Adam's two fp32 moments (8) for every trainable parameter, plus the servable drafter."""
    saved = {"float32": 4, "bfloat16": 2, "float16": 2}[save_dtype]
    params = list(module.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return trainable * 16 + sum(p.numel() for p in params) * saved


def save_checkpoint(engine, world: World, output: Path, step: int, state: dict, config_yaml: str,
                    keep_last: int, save_dtype: str) -> Path:
    """Write checkpoint `step` (see the module docstring). A disk without room for it, before or
    during the write, is an OutputError naming the bytes; the temp folder is removed and every
    earlier checkpoint stays, so `--resume` continues from the newest one."""
    root = Path(output) / "checkpoints"
    tmp = root / f".tmp-{step_name(step)}"
    need = checkpoint_bytes(engine.module, save_dtype)
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    free = shutil.disk_usage(root.parent if not root.is_dir() else root).free
    if free < need:
        raise OutputError(f"--output {output}: checkpoint {step_name(step)} needs about {need / 1e6:.1f} MB but only "
                          f"{free / 1e6:.1f} MB are free; free space and run again with --resume (it continues from "
                          "the newest checkpoint)")
    try:
        return _save_checkpoint(engine, world, output, step, state, config_yaml, keep_last, save_dtype)
    except OutputError:  # the drafter's own write found the disk full: same cleanup
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as exc:
        if not (is_disk_full(exc) or no_room(root)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(root).free
        raise OutputError(f"--output {output}: the disk filled while saving checkpoint {step_name(step)} (it needs "
                          f"about {need / 1e6:.1f} MB, {free / 1e6:.1f} MB are free now); the partial checkpoint was "
                          "removed. Free space and run again with --resume (it continues from the newest "
                          "checkpoint)") from None


def _save_checkpoint(engine, world: World, output: Path, step: int, state: dict, config_yaml: str,
                     keep_last: int, save_dtype: str) -> Path:
    root = Path(output) / "checkpoints"
    final = root / step_name(step)
    tmp = root / f".tmp-{step_name(step)}"
    barrier()
    with gathered_params(engine):
        if world.is_main:
            save_drafter(engine.module, tmp, dtype=save_dtype, own=True, command="train")  # creates tmp
    barrier()
    engine.save_checkpoint(str(tmp / STATE), tag="engine", save_latest=False)
    torch.save({"python": random.getstate(), "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
               tmp / STATE / f"rng-rank{world.rank}.pt")
    barrier()
    if world.is_main:
        (tmp / STATE / "resolved_config.yaml").write_text(config_yaml)
        write_json(tmp / STATE / "state.json", state)
        install_folder(tmp, final, replace_ok=True)  # a step folder of this run, saved again
        for old in list_checkpoints(output)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(engine, world: World, folder: Path) -> dict:
    """Restore engine (module, optimizer, scheduler) and this rank's RNG; return state.json."""
    state_dir = Path(folder) / STATE
    try:
        state = json.loads((state_dir / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{state_dir / 'state.json'}: unreadable ({exc}); delete {folder} to resume from "
                              "the one before") from exc
    try:
        path, _ = engine.load_checkpoint(str(state_dir), tag="engine", load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
        rng_file = state_dir / f"rng-rank{world.rank}.pt"
        rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
    except (RuntimeError, ValueError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        # ValueError: optimizer state of another optimizer (train/optimizer.DeviceAdamW.load_state_dict)
        raise CheckpointError(f"{state_dir}: cannot be loaded ({type(exc).__name__}: {str(exc)[:200]})") from exc
    if path is None:
        raise CheckpointError(f"{state_dir}/engine: DeepSpeed found no engine state; delete {folder} and resume again")
    if rng is not None:
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return state


def save_final(engine, world: World, output: Path, save_dtype: str, extra_files: dict | None = None) -> Path:
    out = Path(output) / "final"
    with gathered_params(engine):
        if world.is_main:  # final/ of this run: replaced when a resumed run ends again
            save_drafter(engine.module, out, dtype=save_dtype, extra_files=extra_files, own=True, command="train")
    barrier()
    return out
