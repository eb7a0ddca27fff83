"""bench/bench_features.py --teachers on CPU at a tiny size: the lean cache and both kl teachers' caches are
written in one run, each timed, and the printed rows name each against the lean one."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_teacher_bench_times_the_lean_cache_and_the_teachers(tmp_path, smollm2_path):
    from conftest import make_train_prepared

    rows = make_train_prepared(tmp_path / "rows", smollm2_path, n=6)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_features.py"), "--teachers", "--prepared",
                          str(rows), "--rows", "6", "--repeats", "1", "--rows-per-shard", "4"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    found = dict(re.findall(r"cache (\w+)\s+[\d.]+ tok/s\s+[\d.]+ s\s+([\d.]+)x the lean", out.stdout))
    assert set(found) == {"lean", "target_vocab", "draft_vocab", "draft_vocab_greedy", "draft_vocab_prompts"}, out.stdout
    assert float(found["lean"]) == 1.0 and all(float(v) > 0 for v in found.values())
