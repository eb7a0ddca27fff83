"""bench/bench_online_features.py on CPU at a tiny size, on the real SmolLM2 target and ShareGPT rows: the
same micro-batches go through the target both ways, the groups compute fewer positions in more forwards,
and their documents are the one padded forward's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_groups_compute_fewer_positions_with_the_one_padded_forwards_features(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_online_features.py"), "--rows", "60",
                          "--max-length", "512", "--tokens", "1024", "--microbatches", "2", "--repeats", "1",
                          "--dtype", "float32", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert len(r["microbatches"]) == 2 and r["dtype"] == "float32"
    assert r["tokens"] <= r["positions"]["grouped"] < r["positions"]["one"]
    assert r["forwards"]["one"] == 2 < r["forwards"]["grouped"]
    assert r["max_feature_diff"] < 1e-4 and r["greedy_equal"] > 0.99
    assert f"groups take {r['ratio']:.2f}x one padded forward's time" in out.stdout
    # `make bench-gpu`'s table cell for the row (its `online` part runs the same bench on a GPU)
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_gpu_all import _figure, headline

    cell = headline({"status": "ok", "tail": "", "rows": [r]})
    assert cell.startswith("online smollm2: tok_s ") and f"time_ratio {_figure(r['ratio'])}" in cell, cell


def test_the_qwen3_8b_shape_has_qwen3_8bs_parameters():
    """The GPU bench's random 8B-class target (built here on the meta device: shapes without memory)."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_online_features import random_target

    model = random_target("qwen3-8b", torch.bfloat16, torch.device("meta"))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(8.19e9, rel=0.01)
    assert len(model.model.layers) == 36 and model.lm_head.weight.shape == (151936, 4096)
    with pytest.raises(SystemExit, match="known shapes are smollm2"):
        random_target("llama-70b", torch.bfloat16, torch.device("meta"))
