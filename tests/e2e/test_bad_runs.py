"""Hostile runs of the installed commands (issue 26): two commands on one output, --overwrite over
files a user added, a disk that fills mid-write, SIGTERM mid-write, progress bars switched off.
Each refusal is exit code 2 with one `error:` line naming the thing, no traceback, and the file
tree as it was (paths, sizes, sha256)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_checks import refused, tree

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "convert"))
from convert_fixtures import smollm2_cfg, write_drafter  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BIN = Path(sys.executable).parent


def env(**extra) -> dict:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "COLUMNS": "200", **extra}


def cli(exe: str, *args, timeout=600, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / exe), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env(**extra))


def prepare(out: Path, *args, **extra) -> subprocess.CompletedProcess:
    return cli("dflash-train", "prepare", "--data", "chitchat", "--max-samples", "8", "--max-turns", "1",
               "--max-length", "128", "--output", out, *args, **extra)


RECIPE = """# target: SmolLM2 (embedded)
data: {{prepared: {rows}, features: memory, holdout_fraction: 0.25}}
drafter: {{num_layers: 1, block_size: 4, mask_token_id: 16, dtype: float32}}
objective: {{anchors_per_document: 16, logits_chunk: 256}}
optim: {{lr: 1.0e-3, epochs: 1}}
batch: {{tokens_per_microbatch: 512}}
checkpoint: {{save_every: 1, keep_last: 2}}
logging: {{log_every: 1, eval_every: 100, progress: false}}
"""


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, smollm2_path):
    from conftest import make_train_prepared

    root = tmp_path_factory.mktemp("bad-runs")
    rows = make_train_prepared(root / "rows", smollm2_path, n=12)
    path = root / "tiny.yaml"
    path.write_text(RECIPE.format(rows=rows))
    return path


# ---- --overwrite replaces only what the toolkit wrote ---------------------------------------

def test_overwrite_never_deletes_a_file_the_user_added(tmp_path):
    rows = tmp_path / "rows"
    assert prepare(rows).returncode == 0
    (rows / "analysis.ipynb").write_text('{"cells": ["do not lose this"]}')
    before = tree(tmp_path)
    refused(prepare(rows, "--overwrite", "--max-length", "96"), f"--output {rows}:",
            "holds files the toolkit did not write there (analysis.ipynb)")
    assert tree(tmp_path) == before
    (rows / "analysis.ipynb").unlink()
    done = prepare(rows, "--overwrite", "--max-length", "96")  # the toolkit's own files alone: replaced
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((rows / "prepare_summary.json").read_text())["inputs"]["max_length"] == 96


def test_convert_overwrite_never_replaces_a_training_run(tmp_path, recipe):
    run = tmp_path / "run"
    done = cli("dflash-train", "train", "--config", recipe, "--output", run, "--max-steps", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    drafter = write_drafter(tmp_path / "drafter", smollm2_cfg())
    before = tree(tmp_path)
    for command in ("to-zlab", "to-speculators"):
        refused(cli("dflash-convert", command, drafter, run, "--overwrite"), f"OUT {run}:",
                "(train, ", "grows in place; --overwrite never replaces it")
    assert tree(tmp_path) == before


# ---- one writer per output ----------------------------------------------------------------

HOLD = """
import sys, time
from dflash_train.output_lock import output_lock
with output_lock(sys.argv[1], "--output", "train"):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def held(tmp_path):
    """An output whose lock another process holds (the real lock, in a real second process)."""
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, env=env())
    assert holder.stdout.readline().strip() == "held"
    yield out, holder.pid
    holder.kill()
    holder.wait()


def test_every_writing_command_refuses_an_output_in_use(held, tmp_path, recipe):
    out, pid = held
    drafter = write_drafter(tmp_path / "drafter", smollm2_cfg())
    rows = tmp_path / "rows"
    assert prepare(rows).returncode == 0
    before = tree(tmp_path)
    owner = f"another command is writing it (train, pid {pid} on {socket.gethostname()}"
    cases = {
        "prepare": ("dflash-train", "prepare", "--data", "chitchat", "--output", out),
        "regenerate": ("dflash-train", "regenerate", "--data", rows, "--output", out),
        "features": ("dflash-train", "features", "--data", rows, "--output", out),
        "train": ("dflash-train", "train", "--config", recipe, "--output", out),
        "init-drafter": ("dflash-train", "init-drafter", "--output", out),
        "to-zlab": ("dflash-convert", "to-zlab", drafter, out),
        "to-speculators": ("dflash-convert", "to-speculators", drafter, out),
    }
    for exe, *args in cases.values():
        flag = "OUT" if exe == "dflash-convert" else "--output"
        refused(cli(exe, *args), f"{flag} {out}: {owner}")
    assert tree(tmp_path) == before  # the holder's lock file included: nobody touched it


@pytest.mark.slow
def test_two_training_runs_into_one_new_folder(tmp_path, recipe):
    out = tmp_path / "run"
    lock = out.with_name(f".{out.name}.dflash-lock")
    first = subprocess.Popen([str(BIN / "dflash-train"), "train", "--config", str(recipe), "--output", str(out),
                              "--max-steps", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    deadline = time.monotonic() + 120
    while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lock.exists(), "the first run never took its lock"
    other = tmp_path / "other.yaml"
    other.write_text(recipe.read_text().replace("lr: 1.0e-3", "lr: 5.0e-4"))  # another recipe, same folder
    refused(cli("dflash-train", "train", "--config", other, "--output", out, "--max-steps", "2"),
            f"--output {out}: another command is writing it (train, pid {first.pid}")
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert "lr: 0.001" in (out / "resolved_config.yaml").read_text()  # the first run's, alone
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    assert not lock.exists()


# ---- progress never decides whether work succeeds ----------------------------------------

@pytest.mark.slow
def test_every_long_command_runs_with_progress_disabled(tmp_path, recipe):
    rows, regen, cache, run = tmp_path / "rows", tmp_path / "regen", tmp_path / "cache", tmp_path / "run"
    off = {"TQDM_DISABLE": "1"}
    steps = [
        ("dflash-train", "prepare", "--data", "chitchat", "--max-samples", "4", "--max-turns", "1",
         "--max-length", "96", "--output", rows),
        ("dflash-train", "regenerate", "--data", rows, "--output", regen, "--max-new-tokens", "4", "--engine", "hf"),
        ("dflash-train", "features", "--data", regen, "--output", cache),
        ("dflash-train", "train", "--config", recipe, "--output", run, "--max-steps", "1"),
        ("dflash-train", "eval", "--draft", run / "final", "--prompts", run, "--num-prompts", "1",
         "--max-new-tokens", "4", "--no-speedup"),
        ("dflash-convert", "to-zlab", run / "final", tmp_path / "zlab"),
    ]
    for exe, *args in steps:
        done = cli(exe, *args, **off)
        assert done.returncode == 0, (args[0], done.stderr[-3000:])
        assert "Traceback" not in done.stderr
    assert json.loads((regen / "prepare_summary.json").read_text())["rows"] >= 1


# ---- a full disk --------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs: `size` bytes and `inodes` files; remount() changes them. Needs root (skipped else)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()

    def mount(size: str, inodes: int, remount: bool = False) -> Path:
        opts = f"{'remount,' if remount else ''}size={size},nr_inodes={inodes}"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
        return mnt

    yield mount
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_prepare_on_a_disk_that_fills_mid_write(small_disk):
    # the byte check passes (50 MB free) but the disk runs out of files while the rows are written
    disk = small_disk("50m", 6)
    out = disk / "rows"
    before = tree(disk)
    line = refused(prepare(out), f"--output {out}: the disk filled while writing it", "it needs at least",
                   "nothing was kept")
    assert "free inodes" in line
    assert tree(disk) == before  # no .tmp-* folder, no lock file
    small_disk("50m", 200, remount=True)
    done = prepare(out)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_a_checkpoint_that_fills_the_disk_then_resume(small_disk, recipe):
    disk = small_disk("400m", 24)  # room for the bytes of every checkpoint, not for the files of the second
    out = disk / "run"
    failed = cli("dflash-train", "train", "--config", recipe, "--output", out, "--max-steps", "3")
    line = refused(failed, f"--output {out}: the disk filled while saving checkpoint step-", "MB",
                   "run again with --resume")
    assert "partial checkpoint was removed" in line
    assert not list((out / "checkpoints").glob(".tmp-*"))
    saved = [p.name for p in (out / "checkpoints").iterdir()]
    small_disk("400m", 2000, remount=True)
    done = cli("dflash-train", "train", "--config", recipe, "--output", out, "--max-steps", "3", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    if saved:
        assert f"resuming from {out / 'checkpoints' / saved[-1]}" in done.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def test_features_refused_for_room_creates_nothing(small_disk, tmp_path):
    rows = tmp_path / "rows"
    assert prepare(rows).returncode == 0
    disk = small_disk("64k", 100)
    out = disk / "cache"
    refused(cli("dflash-train", "features", "--data", rows, "--output", out), f"--output {out}: needs about",
            "free space or choose another location")
    assert not out.exists() and tree(disk) == {}


# ---- SIGTERM mid-write cleans up like Ctrl-C -------------------------------------------------

TERM_MID_WRITE = """
import os, signal, sys
from dflash_train import outputs
real = outputs.write_marker
def marker_then_term(folder, command, **kw):  # the output is written, not yet renamed into place
    if ".tmp-" in str(folder):
        os.kill(os.getpid(), signal.SIGTERM)
    return real(folder, command, **kw)
outputs.write_marker = marker_then_term
sys.argv = sys.argv[1:]
if sys.argv[0].endswith("dflash-convert"):
    from convert.cli import main
else:
    from dflash_train.cli import main
main()
"""


@pytest.mark.parametrize("command", ["prepare", "to-speculators"])
def test_sigterm_while_writing_leaves_no_temp_folder(tmp_path, command):
    out = tmp_path / "out"
    if command == "prepare":
        args = ["dflash-train", "prepare", "--data", "chitchat", "--max-samples", "8", "--output", str(out)]
    else:
        args = ["dflash-convert", "to-speculators", str(write_drafter(tmp_path / "src", smollm2_cfg())), str(out)]
    before = tree(tmp_path)
    done = subprocess.run([sys.executable, "-c", TERM_MID_WRITE, str(BIN / args[0]), *args[1:]], capture_output=True,
                          text=True, timeout=600, env=env())
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: stopped by SIGTERM; temporary files were removed (a resumable command continues "
                      "where it stopped when run again)"]
    assert tree(tmp_path) == before  # no .tmp-* folder, no output, no lock file


def test_a_stale_lock_file_from_a_killed_command_is_taken_over(tmp_path):
    out = tmp_path / "rows"
    stale = out.with_name(f".{out.name}.dflash-lock")
    stale.write_text(json.dumps({"pid": 999999, "host": socket.gethostname(), "command": "prepare"}))
    done = prepare(out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not stale.exists() and (out / "prepare_summary.json").is_file()
    shutil.rmtree(out)


# ---- every input checked before the first write ----------------------------------------------

def test_a_truncated_feature_shard_is_refused_before_the_run_folder_exists(tmp_path, recipe):
    """data.feature_cache with its first shard cut short: one `error:` line naming the shard, and no
    run folder (no resolved_config.yaml, holdout_rows.json or tensorboard/ left behind)."""
    rows = recipe.parent / "rows"
    cache, run = tmp_path / "cache", tmp_path / "run"
    done = cli("dflash-train", "features", "--data", rows, "--output", cache)
    assert done.returncode == 0, done.stderr[-2000:]
    shard = sorted(cache.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    before = tree(tmp_path)
    refused(cli("dflash-train", "train", "--config", recipe, "--output", run, "--max-steps", "1",
                "--set", "data.features=offline", "--set", f"data.feature_cache={cache}"),
            f"{shard}: shard is truncated or corrupt")
    assert tree(tmp_path) == before and not run.exists()
