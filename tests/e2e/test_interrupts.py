"""Ctrl-C at a point the test chooses, not after a delay: the real `dflash-train` in a subprocess whose
chosen function first sends the process SIGINT. Before the final rename, every long data command ends
with exit 130 and the one `error: stopped by SIGINT` line, leaves no output and no temp folder, and the
same command run again finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# patch `module:owner.name` so that its every call sends SIGINT first, then run the CLI as its console script does
HOOK = """
import importlib, os, signal, sys
module, path, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
*owners, name = path.split(".")
mod = importlib.import_module(module)
for owner in owners:
    mod = getattr(mod, owner)
real = getattr(mod, name)

def interrupted(*a, **k):
    os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler at the next bytecode, in the main thread
    return real(*a, **k)

setattr(mod, name, interrupted)
sys.argv = ["dflash-train", *argv]
from dflash_train.cli import main
main()
"""


def dflash(*args, interrupt: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "COLUMNS": "200", "TQDM_DISABLE": "1"}
    if interrupt is None:
        cmd = [str(Path(sys.executable).parent / "dflash-train"), *map(str, args)]
    else:
        module, path = interrupt.split(":")
        cmd = [sys.executable, "-c", HOOK, module, path, *map(str, args)]
    # a shell's background job ignores SIGINT, and a Python started ignoring it never installs its handler:
    # the child gets the default disposition back, however pytest was started
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def stopped(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: stopped by SIGINT"), proc.stderr[-3000:]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith((".tmp-", ".old-")))


def test_ctrl_c_before_the_final_rename(tmp_path):
    """prepare and regenerate at the rename that installs their output; features as its first shard is
    renamed into the cache (in a writer thread: the main thread still ends the command)."""
    rows, regen, cache = tmp_path / "rows", tmp_path / "regen", tmp_path / "cache"
    prepare = ("prepare", "--data", "chitchat", "--max-samples", "6", "--max-turns", "1", "--max-length", "96",
               "--output", rows)
    stopped(dflash(*prepare, interrupt="dflash_train.outputs:install_folder"))
    assert not rows.exists() and leftovers(tmp_path) == []
    assert dflash(*prepare).returncode == 0

    regenerate = ("regenerate", "--data", rows, "--output", regen, "--max-new-tokens", "4", "--engine", "hf")
    stopped(dflash(*regenerate, interrupt="dflash_train.outputs:install_folder"))
    assert not regen.exists() and leftovers(tmp_path) == []
    progress = tmp_path / "regen.partial" / "progress.jsonl"  # every row was generated before the rename
    assert len(progress.read_text().splitlines()) == json.loads((rows / "prepare_summary.json").read_text())["rows"]
    again = dflash(*regenerate)
    assert again.returncode == 0 and "0 of" in again.stderr  # resumed: nothing left to generate
    assert not (tmp_path / "regen.partial").exists()

    features = ("features", "--data", regen, "--output", cache, "--rows-per-shard", "2")
    stopped(dflash(*features, interrupt="dflash_train.features.cache:sha256_file"))
    assert not json.loads((cache / "manifest.json").read_text())["complete"] and leftovers(tmp_path) == []
    assert dflash(*features).returncode == 0
    assert json.loads((cache / "manifest.json").read_text())["complete"]


def test_ctrl_c_mid_render_leaves_nothing(tmp_path):
    rows = tmp_path / "rows"
    prepare = ("prepare", "--data", "chitchat", "--max-samples", "6", "--output", rows)
    stopped(dflash(*prepare, interrupt="dflash_train.data.render:ChatRenderer.render"))
    assert list(tmp_path.iterdir()) == []
