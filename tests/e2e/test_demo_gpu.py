"""`make demo-gpu`'s command, run on CPU at a tiny size: the GPU recipe's stages end to end (regenerate,
train, eval on held-out prompts, convert, validate, z-lab, serve dry run) and the summary a GPU user reads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_demo_gpu_command_runs_every_stage_on_cpu(tmp_path):
    # the recipe's command, as make runs it (under CI's own make, make -n also prints "make[1]: ..." lines)
    make = subprocess.run(["make", "-n", "--no-print-directory", "demo-gpu"], capture_output=True, text=True,
                          cwd=ROOT, check=True).stdout
    lines = [" ".join(x.split()) for x in make.replace("\\\n", " ").splitlines() if "dflash-train demo" in x]
    assert len(lines) == 1, make
    line = lines[0]
    assert "dflash-train demo --config recipes/smollm2-135m-demo-gpu.yaml --output runs/demo-gpu" in line
    args = line.split("dflash-train", 1)[1].split()
    args[args.index("--output") + 1] = str(tmp_path / "demo-gpu")
    args[args.index("--num-prompts") + 1] = "2"
    args[args.index("--max-new-tokens") + 1] = "8"
    tiny = ["data.max_samples=16", "data.regenerate.max_new_tokens=8", "data.regenerate.engine=hf",
            "data.holdout_fraction=0.25", "optim.max_steps=2", "batch.tokens_per_microbatch=1024",
            "objective.anchors_per_document=8", "drafter.num_layers=1", "logging.eval_documents=2",
            "logging.progress=false", f"data.cache_dir={tmp_path / 'cache'}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TQDM_DISABLE": "1", "COLUMNS": "220"}
    done = subprocess.run([str(Path(sys.executable).parent / "dflash-train"), *args,
                           *[a for t in tiny for a in ("--set", t)]], capture_output=True, text=True, env=env,
                          timeout=1200, cwd=ROOT)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    summary = json.loads((tmp_path / "demo-gpu" / "demo_summary.json").read_text())
    assert summary["train_steps"] == 2 and summary["block_size"] == 16 and summary["validate_ok"]
    assert summary["lossless"] is True and summary["prompts"] == 2 and summary["tau"] >= 1.0
    assert set(summary["stage_seconds"]) == {"train", "convert", "eval", "replay", "validate", "to-zlab", "serve"}
    replayed = json.loads((tmp_path / "demo-gpu" / "replay.json").read_text())
    holdout = json.loads((tmp_path / "demo-gpu" / "run" / "holdout_rows.json").read_text())
    assert summary["replay"]["rows"] == replayed["rows"] == len(holdout["rows"])  # every held-out row
    assert summary["replay"]["tau"] == replayed["tau"] >= 1.0 and set(summary["replay"]["per_source"]) <= {"sharegpt"}
    laps = summary["train_stage_seconds"]
    assert list(laps) == ["start", "target_files", "load_target", "prepare_and_regenerate", "features", "setup", "steps", "checks",
                          "checkpoints", "final"]  # the steps' lap without the checks and checkpoints inside it
    assert all(v >= 0 for v in laps.values()) and sum(laps.values()) <= summary["stage_seconds"]["train"]
    assert summary["dtypes"]["engine.precision"]["set_by"].startswith("auto: ")  # the recipe leaves it to the machine
    # RAM: each stage's processes at their peak (the train stage loads the target: at least its ~0.5 GiB of fp32
    # weights), the whole demo's at least its largest stage's; the train run's mark grows lap by lap
    peaks = summary["stage_peak_gib"]
    assert set(peaks) == set(summary["stage_seconds"]) and all(0.05 < v < 16 for v in peaks.values()), peaks
    assert peaks["train"] >= 0.5 and summary["peak_gib"] >= max(peaks.values()), summary["peak_gib"]
    marks = [v["process"] for v in summary["train_memory_high_water_gib"].values()]
    assert list(summary["train_memory_high_water_gib"]) == [k for k in laps if k not in ("checks", "checkpoints")]
    assert marks == sorted(marks) and 0.5 <= marks[-1] <= 1.5 * peaks["train"], (marks, peaks)  # the two measures agree
    assert summary["machine"]["ram_gib"] > 1
    assert re.search(r"RAM at the peak, GiB\s*│?\s*[0-9.]+ \(every stage", done.stdout), done.stdout[-3000:]
    assert (tmp_path / "demo-gpu" / "drafter-zlab" / "config.json").is_file()
    assert re.search(r"train stage seconds\s*│?\s*start=", done.stdout), done.stdout[-3000:]
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_gpu_all import headline  # what `make bench-gpu`'s table shows of this demo

    cell = headline({"status": "ok", "tail": done.stdout})
    assert cell.startswith(f"tau {summary['tau']:.3f}") and f"replayed {summary['replay']['tau']:.3f}" in cell, cell
