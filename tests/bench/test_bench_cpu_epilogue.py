"""bench/bench_cpu_epilogue.py: the eager epilogue against its maths before the exp floor, with the same
gradient, at every logits spread it prints."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_epilogue_bench_prints_a_ratio_and_the_same_gradient_at_each_spread():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_cpu_epilogue.py"), "--rows", "64", "--vocab",
                          "512", "--repeats", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"logits std\s+([\d.]+) \((\d+)% .*?\): before\s+([\d.]+) ms, now\s+([\d.]+) ms, ([\d.]+)x; "
                      r"gradient max diff ([\d.e+-]+)", out.stdout)
    assert [float(r[0]) for r in rows] == [1.0, 8.0, 24.0], out.stdout
    assert int(rows[0][1]) == 0 and int(rows[2][1]) > 0  # the widest spread reaches below the floor
    assert all(float(r[5]) < 1e-4 for r in rows)
