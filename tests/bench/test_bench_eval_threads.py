"""bench/bench_eval_threads.py: the eval's decoding in four real processes (alone, beside spinning processes, with
the cap, the cap alone), one row each with the threads its torch really used, and no spinner left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _spinners() -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"while True: pass" in cmd:
            found.append(int(pid))
    return found


@pytest.mark.slow
def test_four_runs_with_their_threads_and_no_spinner_left(tmp_path):
    rows = tmp_path / "rows.jsonl"
    before = set(_spinners())
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_eval_threads.py"), "--draft", "", "--prompts",
                          "1", "--max-new-tokens", "4", "--busy", "1", "--json", str(rows)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    got = [json.loads(line) for line in rows.read_text().splitlines()]
    cores = got[0]["cores"]
    capped = max(1, cores - 1)
    assert [(r["run"], r["threads"], r["busy"]) for r in got] == [
        ("alone", cores, 0), ("beside", cores, 1), ("capped, beside", capped, 1), ("capped, alone", capped, 0)]
    assert got[0]["ratio"] == 1.0 and all(r["seconds"] > 0 and r["new_tokens"] > 0 for r in got)
    assert abs(got[1]["ratio"] - got[1]["seconds"] / got[0]["seconds"]) < 1e-9
    assert "| beside | " in out.stdout and "/ alone" in out.stdout
    assert set(_spinners()) <= before  # every spinning process was killed
