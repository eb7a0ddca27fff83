"""A stopped pipeline stops its stages: `dflash-train demo` or `sweep` killed alone (a scheduler's SIGTERM) or
interrupted from a terminal hands the signal to each running stage once, which cleans up as it would alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# a stage: writes its pid (atomically), then on a signal waits 0.5 s (a second one would be recorded), writes the names and exits
CHILD = r"""
import os, signal, sys, time
from pathlib import Path
out, ignore = Path(sys.argv[1]), sys.argv[2] == "ignore"
got = []
def handler(signum, frame):
    got.append(signal.Signals(signum).name)
    if len(got) == 1 and not ignore:
        time.sleep(0.5)  # cleaning up; a second delivery would be counted
        out.with_suffix(".stopped").write_text(" ".join(got))
        sys.exit(128 + signum)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, handler)
# whole or not at all: the test reads the pid as soon as the file exists (an empty read failed a CI run)
out.with_suffix(".pid.tmp").write_text(str(os.getpid()))
os.replace(out.with_suffix(".pid.tmp"), out.with_suffix(".pid"))
while True:
    time.sleep(0.05)
"""

# the pipeline: `run_cli` around run_stage (main) or the demo's lanes, as `dflash-train demo` / `sweep` run them
PARENT = r"""
import io, signal, sys
from pathlib import Path
# as a terminal's shell starts it: a pytest started in the background (`make test &`, nohup) hands its children
# SIGINT and SIGHUP ignored, which run_cli keeps ignored (nohup's meaning), and a Ctrl-C would then reach nothing
for s in (signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_DFL)
import dflash_train.stages as stages
from dflash_train.demo import run_lanes
from dflash_train.errors import run_cli
from dflash_train.stages import Stage, run_stage
folder, child, mode, grace = Path(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
stages.GRACE_S = grace
def stage(name, behaviour="stop"):
    return Stage(name, [sys.executable, "-c", child, str(folder / name), behaviour])
if mode == "race":  # the stop lands after the stage has started, before the pipeline has registered it
    import os, signal, subprocess, time
    class Late(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            while not (folder / "train.pid").exists():
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # an unheld handler runs here, and the stage is never told
    subprocess.Popen = Late
    mode = "stop"
if mode == "lane-race":  # the same in the side lane, where no signal can be held: the main lane's stop runs meanwhile
    import os, signal, subprocess, time
    class LateInLane(subprocess.Popen):
        def __init__(self, args, **kwargs):
            super().__init__(args, **kwargs)
            if str(folder / "validate") in args:
                # the main lane's eval has started too (on a loaded machine it may start after validate)
                while not ((folder / "validate.pid").exists() and (folder / "eval.pid").exists()):
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGTERM)
                end = time.monotonic() + 30  # the main thread's stop_stages reaches eval, then this registers
                while not (folder / "eval.stopped").exists() and time.monotonic() < end:
                    time.sleep(0.01)
                time.sleep(0.5)
    subprocess.Popen = LateInLane
    mode = "lanes"
if mode == "lanes":  # eval in the main lane, validate beside it
    convert = Stage("convert", [sys.executable, "-c", "pass"])
    run_cli(lambda: run_lanes([convert, stage("eval"), stage("validate")], io.StringIO(), [("validate",)]))
else:
    run_cli(lambda: run_stage(stage("train", mode), io.StringIO()))
"""


def start(tmp_path: Path, mode: str, grace: float = 30.0) -> subprocess.Popen:
    # a session of its own, so a signal to its group reaches nothing of pytest's; default dispositions
    return subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), CHILD, mode, str(grace)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(*paths: Path, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < end, f"{[str(p) for p in paths if not p.exists()]} never appeared"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("to_group", [False, True], ids=["kill-the-pipeline-alone", "ctrl-c-to-the-terminal-group"])
def test_a_stopped_pipeline_hands_the_signal_to_its_stage_once(tmp_path, to_group):
    signum = signal.SIGINT if to_group else signal.SIGTERM
    parent = start(tmp_path, "stop")
    wait_for(tmp_path / "train.pid")
    pid = int((tmp_path / "train.pid").read_text())
    (os.killpg if to_group else os.kill)(parent.pid, signum)
    out, err = parent.communicate(timeout=60)
    assert parent.returncode == 128 + signum, err
    assert f"error: stopped by {signal.Signals(signum).name}" in err
    # the pipeline names the stage it cut and says that the same command runs it again
    cut = [line for line in out.splitlines() if line.startswith("[demo] train") and "stopped after" in line]
    assert len(cut) == 1 and "the same command runs this stage again" in cut[0], out
    # the stage got the signal exactly once (a terminal's Ctrl-C reached only the pipeline), and has ended
    assert (tmp_path / "train.stopped").read_text() == signal.Signals(signum).name
    assert not alive(pid)


def test_a_stop_between_a_stages_start_and_its_registration_still_reaches_it(tmp_path):
    # a signal there used to raise before the stage was registered: the stage, in a session of its own, never heard
    # of it and ran on, orphaned, holding the pipeline's stderr (its caller hung on it)
    parent = start(tmp_path, "race")
    try:
        _, err = parent.communicate(timeout=60)
        assert parent.returncode == 128 + signal.SIGINT, err
        assert (tmp_path / "train.stopped").read_text() == "SIGINT"
        assert not alive(int((tmp_path / "train.pid").read_text()))
    finally:
        if (tmp_path / "train.pid").exists() and alive(pid := int((tmp_path / "train.pid").read_text())):
            os.kill(pid, signal.SIGKILL)
        parent.kill()


def test_a_stage_that_does_not_end_is_killed_after_the_grace_period(tmp_path):
    parent = start(tmp_path, "ignore", grace=1.0)
    wait_for(tmp_path / "train.pid")
    pid = int((tmp_path / "train.pid").read_text())
    t0 = time.monotonic()
    os.kill(parent.pid, signal.SIGTERM)
    _, err = parent.communicate(timeout=60)
    assert parent.returncode == 128 + signal.SIGTERM, err
    assert 0.9 < time.monotonic() - t0 < 20
    assert not alive(pid) and not (tmp_path / "train.stopped").exists()


def test_the_demos_side_lane_stops_with_the_main_lane(tmp_path):
    parent = start(tmp_path, "lanes")
    wait_for(tmp_path / "eval.pid", tmp_path / "validate.pid")
    pids = [int((tmp_path / f"{n}.pid").read_text()) for n in ("eval", "validate")]
    os.kill(parent.pid, signal.SIGTERM)
    _, err = parent.communicate(timeout=60)
    assert parent.returncode == 128 + signal.SIGTERM, err
    for name, pid in zip(("eval", "validate"), pids, strict=True):
        assert (tmp_path / f"{name}.stopped").read_text() == "SIGTERM", name
        assert not alive(pid), name


def test_a_stop_while_the_side_lane_starts_a_stage_still_reaches_that_stage(tmp_path):
    # the lane's stage starts, the main thread's stop_stages runs before the lane registers it: the lane stops it
    # itself (before, it ran on unsignalled and the pipeline waited on its lane forever)
    parent = start(tmp_path, "lane-race")
    try:
        _, err = parent.communicate(timeout=60)
        assert parent.returncode == 128 + signal.SIGTERM, err
        for name in ("eval", "validate"):
            assert (tmp_path / f"{name}.stopped").read_text() == "SIGTERM", name
            assert not alive(int((tmp_path / f"{name}.pid").read_text())), name
    finally:
        for name in ("eval", "validate"):
            if (tmp_path / f"{name}.pid").exists() and alive(pid := int((tmp_path / f"{name}.pid").read_text())):
                os.kill(pid, signal.SIGKILL)
        parent.kill()
