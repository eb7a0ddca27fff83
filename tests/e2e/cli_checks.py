"""Checks shared by the bad-input and bad-output e2e suites: a refusal is exit code 2, one
`error:` line naming the thing, no traceback; and the file tree is the same before and after."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path


def tree(root: Path) -> dict[str, tuple]:
    """Every path under `root` with its size and sha256 (folders as such): equal trees mean
    nothing was written, replaced or deleted."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = ("dir",) if path.is_dir() else (path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def refused(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, no traceback, one `error:` line holding every needle; returns that line."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]
