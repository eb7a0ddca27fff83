"""`dflash-train eval` as a user runs it: real SmolLM2 target, a saved drafter, a trainer run folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

# the script beside this interpreter: CI runs .venv/bin/pytest without activating the venv
EXE = str(Path(sys.executable).parent / "dflash-train")


def _env():
    # one thread: small multi-row matmuls with MKL threads on a shared 2-core machine crawl
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory, smollm2_path):
    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.model.init import new_drafter_for_target

    run = tmp_path_factory.mktemp("train-run")
    model = new_drafter_for_target(str(smollm2_path), num_layers=1, block_size=6, seed=0, dtype="float32")
    save_drafter(model, run / "final")
    return run


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": "What is 12 + 7?", "source": "math"},
            {"messages": [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_eval_writes_report_and_plot(run_folder, prompts, smollm2_path, tmp_path):
    exe = EXE
    out_json, out_png = tmp_path / "eval.json", tmp_path / "eval.png"
    proc = subprocess.run([exe, "eval", "--draft", str(run_folder), "--target", str(smollm2_path),
                           "--prompts", str(prompts), "--max-new-tokens", "8", "--block-size", "4",
                           "--json", str(out_json), "--plot", str(out_png)],
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "lossless: yes" in proc.stdout and "tau" in proc.stdout
    report = json.loads(out_json.read_text())
    for key in ("tau", "per_position", "histogram", "speedup", "lossless", "prompts", "settings"):
        assert key in report
    assert report["lossless"] is True and report["tau"] >= 1.0 and report["speedup"] > 0
    assert report["draft"] == str(run_folder / "final")
    assert report["settings"]["block_size"] == 4 and len(report["histogram"]) == 4
    assert len(report["prompts"]) == 2
    # tau per prompt source: the labelled row and the unlabelled one
    assert list(report["per_source"]) == ["math", "unlabelled"]
    assert [v["prompts"] for v in report["per_source"].values()] == [1, 1]
    first = report["prompts"][0]
    assert report["per_source"]["math"]["tau"] == first["tau"] and first["source"] == "math"
    assert "tau by prompt source: math" in proc.stdout
    # greedy: the teacher-forced diagnosis of the same sequences is in the report and the summary
    assert report["teacher_forced"]["steps"] == report["target_forwards"]
    assert "teacher-forced block acceptance" in proc.stdout
    assert all(1 <= p["new_tokens"] <= 8 for p in report["prompts"])
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_eval_rejects_a_block_larger_than_trained(run_folder, prompts):
    proc = subprocess.run([EXE, "eval", "--draft", str(run_folder), "--prompts", str(prompts),
                           "--block-size", "12"], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 2
    assert "--block-size 12" in proc.stderr and "trained block_size 6" in proc.stderr
    assert "Traceback" not in proc.stderr
