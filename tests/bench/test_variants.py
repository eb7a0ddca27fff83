"""The GPU benches' command-line shape (bench/variants.py), on CPU: `--list`, one variant per call, one
JSON line per finished variant appended at once, and a failed variant recorded as a row with its error
while the run goes on. Real subprocesses of the bench scripts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench(script, *args, timeout=300):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def _rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.parametrize("script, names", [
    ("bench_train_gpu.py", ["split-1", "flex-1", "dense-1", "split-5", "flex-5", "dense-5", "flex-ckpt-5",
                           "flex-1-eager", "flex-5-eager", "flex-5-eager-head", "flex-5-eager-layers", "train",
                           "train-v8k", "train-all-slots"]),
    ("bench_gpu_data.py", ["regen", "regen-f25d61f", "regen-generate", "regen-eager", "regen-compiled",
                            "features"])])
def test_list_prints_every_variant_and_an_unknown_one_is_refused(script, names):
    out = _bench(script, "--list", timeout=60)
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines()] == names
    bad = _bench(script, "--variant", "nope", timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'nope'" in bad.stderr


@pytest.mark.slow
def test_each_variant_appends_its_row_and_a_failure_is_a_row_too(tmp_path):
    """Three calls into one --json file: a measured variant, a CPU-impossible one (flex: an error row
    without a subprocess) and one that runs past --timeout (killed: an error row, the run goes on)."""
    rows = tmp_path / "rows.jsonl"
    ok = _bench("bench_train_gpu.py", "--smoke", "--variant", "split-1", "--json", rows)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert len(_rows(rows)) == 1  # written by the time the call returns
    na = _bench("bench_train_gpu.py", "--smoke", "--variant", "flex-1", "--json", rows)
    assert na.returncode == 0
    # 0.5 s is less than the child needs to import torch: killed; the next variant still runs
    slow = _bench("bench_train_gpu.py", "--smoke", "--variant", "dense-1", "--variant", "split-1",
                  "--timeout", "0.5", "--json", rows)
    assert slow.returncode == 1 and "failed: dense-1, split-1" in slow.stdout
    got = _rows(rows)
    assert [r["variant"] for r in got] == ["split-1", "flex-1", "dense-1", "split-1"]
    first = got[0]
    assert first["layers"] == 1 and first["attention"] == "split" and "error" not in first
    assert 0 < first["step_s"] < 30 and first["positions"] > 0 and first["flops"] > 0 and first["device"] == "CPU"
    assert got[1]["error"].startswith("n/a on CPU")
    assert got[2]["error"] == "timed out after 0.5 s" and got[3]["error"] == "timed out after 0.5 s"
    assert "| 1 layer | dense | timed out after 0.5 s |" in slow.stdout


@pytest.mark.slow
def test_the_train_variant_profiles_steps_after_its_timed_ones(tmp_path):
    """`--profile N` on `train`: the same `dflash-train train` run goes N steps further under the profiler
    (logging.profile_steps), and its profile.json is the row's `profile`; `train-v8k` trains its head,
    `train-all-slots` every slot of a block."""
    rows = tmp_path / "rows.jsonl"
    out = _bench("bench_train_gpu.py", "--smoke", "--variant", "train", "--variant", "train-v8k", "--variant",
                 "train-all-slots", "--profile", "2", "--json", rows)
    assert out.returncode == 0, out.stderr[-2000:]
    row, reduced, every = _rows(rows)
    assert row["tokens_per_s"] > 0 and row["steps"] == 3  # the timed window: log 1 to log 4, before the profile
    prof = row["profile"]
    assert prof["first_step"] == 4 and prof["steps"] == prof["profiled_steps"] == 2 and prof["trace"]
    assert prof["kernel_ms_per_step"] and 0 < prof["device_busy"] <= 1
    assert "profile (2 steps)" in out.stdout
    # train-v8k: the same run with its head trained (the smoke keeps its small vocabulary for both)
    assert (row["head"], reduced["head"]) == ("frozen", "trained") and row["draft_vocab"] == reduced["draft_vocab"] == 2048
    assert reduced["tokens_per_s"] > 0 and "a trained head of 2,048 ids" in out.stdout
    # the recipe trains slots 1-7 of its B=16 blocks; train-all-slots lifts the cut
    assert (row["trained_slots"], every["trained_slots"]) == ("7", "null") and every["tokens_per_s"] > 0
    assert "B=16 (slots 1-7 trained)" in out.stdout and "B=16 (every slot trained)" in out.stdout


def test_a_variant_that_raises_is_a_row_with_its_exception(tmp_path):
    """The child's own failure (here: no ShareGPT-prepared rows where the spec points) becomes the row's
    error, named by its exception line, not a crash of the bench."""
    sys.path.insert(0, str(ROOT / "bench"))
    from variants import run_child

    spec = {"kind": "features", "device": "cpu", "data": str(tmp_path / "missing"), "work": str(tmp_path),
            "threads": 1, "regen_rows": 1, "max_new_tokens": 1, "repeats": 1}
    r = run_child(str(ROOT / "bench" / "bench_gpu_data.py"), spec, timeout=240)
    assert r["exit_code"] == 1 and "Error" in r["error"] and "missing" in r["stderr_tail"]


def test_a_git_archive_of_the_benches_still_names_its_commit(tmp_path):
    """A GPU machine gets the project as `git archive HEAD` (no .git): the rows must still name the commit."""
    import tarfile

    root = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "log", "-1", "--format=%h"], capture_output=True, text=True, cwd=root)
    if head.returncode or not head.stdout.strip():
        pytest.skip("not a git checkout")
    archive = tmp_path / "proj.tar"
    subprocess.run(["git", "archive", "-o", str(archive), "HEAD", "bench"], check=True, cwd=root)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "proj", filter="data")
    out = subprocess.run([sys.executable, "-c", "from variants import commit; print(commit())"], capture_output=True,
                         text=True, cwd=tmp_path / "proj" / "bench", env={"PATH": "/usr/bin:/bin", "GIT_DIR": "/nonexistent"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == head.stdout.strip()


def test_a_regeneration_variant_writes_each_pass_as_it_ends(tmp_path):
    """`regen` writes a row per pass before its own (a part cut by its deadline keeps what it finished: the
    2026-12-04 H200 run lost both passes), and its row's numbers are its last pass's."""
    rows = tmp_path / "rows.jsonl"
    out = _bench("bench_gpu_data.py", "--smoke", "--variant", "regen", "--variant", "regen-eager", "--json", rows)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second, row, *eager = _rows(rows)
    assert (first["partial"], second["partial"]) == ("pass 1 of 2", "pass 2 of 2") and "partial" not in row
    assert first["variant"] == second["variant"] == row["variant"] == "regen" and first["commit"] == row["commit"]
    assert row["first_s"] == first["seconds"] and row["seconds"] == second["seconds"] and row["tok_s"] == second["tok_s"]
    assert second["new_tokens"] == row["new_tokens"] > 0
    # the eager loop after it: its own passes, then a row compared with `regen`'s (on a CPU both are eager)
    assert [r.get("partial") for r in eager] == ["pass 1 of 2", "pass 2 of 2", None]
    assert eager[-1]["variant"] == "regen-eager" and eager[-1]["identical_rows"] == row["rows"] and eager[-1]["speedup"] > 0
    assert "| regeneration, this toolkit's HF path, decode step eager |" in out.stdout and "first pass" in out.stdout
