"""bench/bench_head.py on CPU at a tiny shape: both epilogues measured in one run, and they agree."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_head_bench_times_eager_and_compiled_and_they_agree():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_head.py"), "--m", "96", "--hidden", "32",
                          "--vocab", "300", "--steps", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.stdout.splitlines() if line.startswith(("| ce", "| kl"))}
    assert set(rows) == {"ce", "kl"}
    for chunk, eager, compiled, ratio, loss_diff, grad_diff in rows.values():
        assert chunk == "1024" and float(eager) > 0 and float(compiled) > 0
        assert float(ratio) > 0
        assert float(loss_diff) < 1e-5 and float(grad_diff) < 1e-5
