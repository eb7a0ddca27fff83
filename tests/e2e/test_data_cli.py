"""The installed `dflash-train prepare / regenerate / features` commands in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def run(*args, env=None):
    # the script beside this interpreter: CI runs .venv/bin/pytest without activating the venv
    exe = str(Path(sys.executable).parent / "dflash-train")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600,
                          env=None if env is None else {**os.environ, **env})


@pytest.mark.slow  # ~26 s
def test_prepare_then_features_then_errors(tmp_path):
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Count to {i}.", "response": " ".join(map(str, range(1, i + 2)))})
                           + "\n" for i in range(4)))
    r = run("prepare", "--data", str(src), "--output", str(tmp_path / "p"), "--max-length", "40")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "p" / "prepare_summary.json").read_text())
    assert summary["rows"] == 4 and summary["supervised_tokens"] > 4
    assert (tmp_path / "p" / "token_freq.json").is_file()

    r = run("features", "--data", str(tmp_path / "p"), "--output", str(tmp_path / "f"),
            "--layer-ids", "2,9", "--rows-per-shard", "3", "--batch-size", "2")
    assert r.returncode == 0, r.stderr
    assert "4 rows" in r.stdout and "2 shards" in r.stdout
    # 2 layers x 576 bf16 + 17 bytes = 2321 bytes per token
    assert "2.32 GB per 1M tokens (2 layers x 576 bfloat16" in r.stdout and "tokens/s" in r.stdout
    m = json.loads((tmp_path / "f" / "manifest.json").read_text())
    assert m["complete"] and m["target_layer_ids"] == [2, 9] and m["feature_dim"] == 2 * 576
    r = run("features", "--data", str(tmp_path / "p"), "--output", str(tmp_path / "f-lean"),
            "--layer-ids", "2,9", "--rows-per-shard", "3", "--batch-size", "2", "--no-greedy")
    assert r.returncode == 0, r.stderr
    assert "without greedy tokens" in r.stdout and m["greedy_next"] is True
    assert json.loads((tmp_path / "f-lean" / "manifest.json").read_text())["greedy_next"] is False

    # two sources mixed: each capped by --max-samples, each row labelled with its source
    r = run("prepare", "--data", str(src), "--data", "chitchat", "--max-samples", "3", "--output",
            str(tmp_path / "mix"), "--max-length", "64")
    assert r.returncode == 0, r.stderr
    mix = json.loads((tmp_path / "mix" / "prepare_summary.json").read_text())
    assert mix["rows_in"] == 6 and mix["rows_by_source"]["chats"] == 3  # a chitchat row may drop (too long)
    assert set(mix["rows_by_source"]) == {"chats", "chitchat"} and sum(mix["rows_by_source"].values()) == mix["rows"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    r = run("prepare", "--data", str(bad), "--output", str(tmp_path / "b"))
    assert r.returncode == 2 and "unknown schema" in r.stderr and "['text']" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "b").exists()

    # no vLLM here and $DFLASH_VLLM_PYTHON names nothing: a one-line error with the fixes, no output
    r = run("regenerate", "--data", str(tmp_path / "p"), "--output", str(tmp_path / "r"), "--engine", "vllm",
            env={"DFLASH_VLLM_PYTHON": str(tmp_path / "no-python")})
    assert r.returncode == 2 and "DFLASH_VLLM_PYTHON" in r.stderr and "make vllm-venv" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_regenerate_cli(tmp_path):
    r = run("prepare", "--data", "chitchat", "--output", str(tmp_path / "p"), "--max-samples", "6",
            "--max-length", "64")
    assert r.returncode == 0, r.stderr
    r = run("regenerate", "--data", str(tmp_path / "p"), "--output", str(tmp_path / "r"),
            "--max-new-tokens", "4", "--batch-size", "4")
    assert r.returncode == 0, r.stderr
    assert "tok_s=" in r.stderr  # the progress bar reports rows and tokens per second
    s = json.loads((tmp_path / "r" / "prepare_summary.json").read_text())
    assert s["rows"] >= 1 and s["regeneration"]["turns"] >= 1 and s["inputs"]["command"] == "regenerate"
