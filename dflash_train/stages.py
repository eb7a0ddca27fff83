"""Installed commands run as stages: one subprocess each, exactly as a user would type it.

A stage names the file that exists once its output is complete; such a stage is skipped, so a
pipeline of stages (the demo, a sweep) resumes where it stopped. stdout is kept for the caller's
summary and the log; stderr (the progress bars) goes through to the terminal.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_train.errors import DFlashError


@dataclass
class Stage:
    name: str
    argv: list[str]
    done: Path | None = None  # this file exists when the stage's output is complete
    allowed_exit: tuple[int, ...] = (0,)
    seconds: float = 0.0
    status: str = "pending"
    output: list[str] = field(default_factory=list)


def command_path(name: str) -> str:
    """The installed console script next to this interpreter (or on PATH)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def run_stage(stage: Stage, log, prefix: str = "[demo]") -> None:
    """Run `stage` (or skip it when its `done` file exists); a failure raises with its output's tail."""
    t0 = time.time()
    if stage.done is not None and stage.done.exists():
        stage.status = "cached"
        print(f"{prefix} {stage.name:9s} cached ({stage.done})", flush=True)
        return
    print(f"{prefix} {stage.name:9s} $ {' '.join(stage.argv)}", flush=True)
    log.write(f"\n$ {' '.join(stage.argv)}\n")
    log.flush()
    proc = subprocess.Popen(stage.argv, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    for line in proc.stdout:
        stage.output.append(line.rstrip("\n"))
        log.write(line)
    code = proc.wait()
    stage.seconds = time.time() - t0
    if code not in stage.allowed_exit:
        tail = "\n".join(stage.output[-15:])
        raise DFlashError(f"{prefix.strip('[]')} stage `{stage.name}` failed (exit {code}); its output:\n{tail}")
    stage.status = "ok"
    print(f"{prefix} {stage.name:9s} ok in {stage.seconds:.0f}s", flush=True)
