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
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from convert.weights import write_json
from dflash_train.errors import CheckpointError
from dflash_train.model.checkpoint import save_drafter
from dflash_train.train.engine import World, barrier, gathered_params

STATE = "trainer_state"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(output: Path) -> list[Path]:
    root = Path(output) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step-*") if (p / STATE / "state.json").is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(output: Path) -> Path | None:
    ckpts = list_checkpoints(output)
    return ckpts[-1] if ckpts else None


def save_checkpoint(engine, world: World, output: Path, step: int, state: dict, config_yaml: str,
                    keep_last: int, save_dtype: str) -> Path:
    root = Path(output) / "checkpoints"
    final = root / step_name(step)
    tmp = root / f".tmp-{step_name(step)}"
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    barrier()
    with gathered_params(engine):
        if world.is_main:
            save_drafter(engine.module, tmp, dtype=save_dtype)  # creates tmp
    barrier()
    engine.save_checkpoint(str(tmp / STATE), tag="engine", save_latest=False)
    torch.save({"python": random.getstate(), "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
               tmp / STATE / f"rng-rank{world.rank}.pt")
    barrier()
    if world.is_main:
        (tmp / STATE / "resolved_config.yaml").write_text(config_yaml)
        write_json(tmp / STATE / "state.json", state)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
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
    path, _ = engine.load_checkpoint(str(state_dir), tag="engine", load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"{state_dir}/engine: DeepSpeed found no engine state; delete {folder} and resume again")
    rng_file = state_dir / f"rng-rank{world.rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return state


def save_final(engine, world: World, output: Path, save_dtype: str, extra_files: dict | None = None) -> Path:
    out = Path(output) / "final"
    with gathered_params(engine):
        if world.is_main:
            save_drafter(engine.module, out, dtype=save_dtype, extra_files=extra_files)
    barrier()
    return out
