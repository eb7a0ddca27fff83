"""Finding the drafter inside a folder: a checkpoint itself, or a training run's newest one.

A training run holds `final/` and `checkpoints/step-N/`; the drafter files sit at the top of
those folders (or in one `drafter/` / `model/` subfolder for other trainers). A checkpoint is
complete when it has a config.json and readable weight files.
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash_train.errors import CheckpointError
from dflash_train.model.weights import weight_files

STEP_DIR = re.compile(r"^step-(\d+)$")
_INNER = ("", "drafter", "model")


def is_complete_checkpoint(folder: Path) -> bool:
    if not (folder / "config.json").is_file():
        return False
    try:
        weight_files(folder)
    except CheckpointError:
        return False
    return True


def _complete_inside(folder: Path) -> Path | None:
    for inner in _INNER:
        candidate = folder / inner if inner else folder
        if candidate.is_dir() and is_complete_checkpoint(candidate):
            return candidate
    return None


def newest_run_checkpoint(run: Path) -> Path | None:
    """`run/final` if complete, else the complete `run/checkpoints/step-N` with the largest N."""
    run = Path(run)
    if (found := _complete_inside(run / "final")) is not None:
        return found
    steps_dir = run / "checkpoints"
    steps = sorted(((int(m.group(1)), p) for p in steps_dir.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))),
                   reverse=True) if steps_dir.is_dir() else []
    for _, step in steps:
        if (found := _complete_inside(step)) is not None:
            return found
    return None


def find_drafter_folder(path: str | Path) -> Path | None:
    """`path` when it is a complete checkpoint, else a run folder's newest complete checkpoint."""
    path = Path(path)
    if not path.is_dir():
        return None
    if is_complete_checkpoint(path):
        return path
    return newest_run_checkpoint(path)


def require_drafter_folder(path: str | Path, name: str | None = None) -> Path:
    """`find_drafter_folder(path)`, or a CheckpointError that names `name` (the flag and value a user gave; default
    the path) and says what to give instead."""
    path = Path(path)
    name = name or str(path)
    give = "give a drafter checkpoint folder (speculators or z-lab) or a training run folder"
    if not path.is_dir():
        raise CheckpointError(f"{name}: {'a file, not a folder' if path.exists() else 'no such folder'}; {give}")
    found = find_drafter_folder(path)
    if found is None:
        raise CheckpointError(f"{name}: no config.json with weights here, no final/ and no complete "
                              f"checkpoints/step-*/ folder; {give}")
    return found
