"""Installed commands run as stages: one subprocess each, exactly as a user would type it.

A stage names the file that exists once its output is complete; such a stage is skipped, so a
pipeline of stages (the demo, a sweep) resumes where it stopped, unless that output is out of date:
older than an earlier stage's output it was made from, or made from other settings (a recipe that
changed since). stdout is kept for the caller's summary and the log; stderr (the progress bars) goes
through to the terminal.

A stage runs in a session of its own, so a terminal's Ctrl-C or hang-up reaches only this process, which
hands the signal on once to every stage still running (`stop_stages`): each cleans up as the command would
alone, and is killed if it has not ended after GRACE_S. A `kill` of this process alone (a scheduler's
SIGTERM) therefore stops its stages too, instead of leaving them running without it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_train.errors import DFlashError, Stopped, signals_held
from dflash_train.peak_memory import TreePeak, gib


@dataclass
class Stage:
    name: str
    argv: list[str]
    done: Path | None = None  # this file exists when the stage's output is complete
    allowed_exit: tuple[int, ...] = (0,)
    after: tuple[Path, ...] = ()  # earlier stages' outputs this one is made from: a `done` older than one is redone
    # why the existing output was made from other settings (None: it was not, or there is none); the stage's
    # own folder `replaces` is then removed before it runs again
    stale: Callable[[], str | None] | None = None
    replaces: Path | None = None
    threads: int | None = None  # CPU threads its torch may use (OMP_NUM_THREADS); None: the default, every core
    seconds: float = 0.0
    peak_bytes: int = 0  # its processes' anonymous resident memory at their peak, summed (peak_memory.TreePeak)
    status: str = "pending"
    output: list[str] = field(default_factory=list)


GRACE_S = 30.0  # a stopped stage's time to clean up (temporary folders, locks) before it is killed
_running: set[subprocess.Popen] = set()  # the stages' processes now running, in every lane
_running_lock = threading.Lock()
# the signal of the last `stop_stages` since `allow_stages`: a lane (a thread, where no signal can be held) that
# registers a stage after it stops that stage at once, and starts no other
_stopped_by: int | None = None


def allow_stages() -> None:
    """A pipeline's lanes are about to start: forget an earlier stop (a stop before this pipeline began)."""
    global _stopped_by
    with _running_lock:
        _stopped_by = None


def stop_stages(signum: int = signal.SIGTERM, grace: float | None = None) -> None:
    """Send `signum` to every stage still running, wait up to `grace` seconds (default GRACE_S) for them all,
    kill the rest. A lane's stage registered after this is stopped by its lane (`run_stage`)."""
    global _stopped_by
    with _running_lock:
        _stopped_by = signum
        procs = [p for p in _running if p.poll() is None]
    for proc in procs:
        _signal(proc, signum)
    deadline = time.monotonic() + (GRACE_S if grace is None else grace)
    for proc in procs:
        _end(proc, deadline)


def _end(proc: subprocess.Popen, deadline: float) -> None:
    """Wait for a signalled stage until `deadline` (time.monotonic()), then kill it."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _signal(proc: subprocess.Popen, signum: int) -> bool:
    """Send `signum` to a stage; False when it has already gone."""
    try:
        proc.send_signal(signum)
    except ProcessLookupError:
        return False
    return True


def _stop_one(proc: subprocess.Popen, signum: int, grace: float) -> None:
    if _signal(proc, signum):
        _end(proc, time.monotonic() + grace)


def command_path(name: str) -> str:
    """The installed console script next to this interpreter (or on PATH)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def out_of_date(stage: Stage) -> str | None:
    """Why the stage's existing output cannot be kept (None: it can, or there is none)."""
    why = stage.stale() if stage.stale is not None else None
    if why:
        return why
    if stage.done is not None and stage.done.exists():
        made = stage.done.stat().st_mtime_ns
        newer = [p for p in stage.after if p.exists() and p.stat().st_mtime_ns > made]
        if newer:
            return f"{newer[0]} is newer than {stage.done}"
    return None


_journal_lock = threading.Lock()


def write_journal(journal: Path | None, stage: Stage, t0: float) -> None:
    """One JSON line in `journal` as `stage` ends (ok, cached, failed or stopped): what a pipeline cut by a
    deadline or a kill still says of the stages it finished; the lanes' log lines are only written at the end."""
    if journal is None:
        return
    import json

    line = json.dumps({"stage": stage.name, "status": stage.status, "seconds": round(time.time() - t0, 2),
                       "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    with _journal_lock, open(journal, "a") as f:
        f.write(line + "\n")


def run_stage(stage: Stage, log, prefix: str = "[demo]", journal: Path | None = None) -> None:
    """Run `stage`, or skip it when its `done` file exists and is not out of date; a failure raises with its
    output's tail. `journal`: a file that gets one line as the stage ends (`write_journal`)."""
    t0 = time.time()
    try:
        _run_stage(stage, log, prefix, t0)
    except BaseException:
        if stage.status == "pending":  # cut before it ended (a failed stage says so itself)
            stage.status = "stopped"
        raise
    finally:
        write_journal(journal, stage, t0)


def _run_stage(stage: Stage, log, prefix: str, t0: float) -> None:
    why = out_of_date(stage)
    if why is None and stage.done is not None and stage.done.exists():
        stage.status = "cached"
        print(f"{prefix} {stage.name:9s} cached ({stage.done})", flush=True)
        return
    if why is not None:
        replaced = f"; {stage.replaces} is removed" if stage.replaces is not None and stage.replaces.exists() else ""
        print(f"{prefix} {stage.name:9s} out of date ({why}){replaced}: running it again", flush=True)
        log.write(f"\n# {stage.name}: out of date ({why}){replaced}\n")
        if replaced:
            shutil.rmtree(stage.replaces)
    print(f"{prefix} {stage.name:9s} $ {' '.join(stage.argv)}", flush=True)
    log.write(f"\n$ {' '.join(stage.argv)}\n")
    log.flush()
    env = None if stage.threads is None else {**os.environ, "OMP_NUM_THREADS": str(stage.threads)}
    in_lane = threading.current_thread() is not threading.main_thread()
    if in_lane and _stopped_by is not None:  # the pipeline stopped: no lane starts another stage
        raise Stopped(_stopped_by)
    proc = None
    try:
        # a stop that lands between the start and the registration is handled once the stage is registered:
        # before, the stage (in a session of its own) never heard of it and ran on, orphaned. The main thread
        # holds the signal meanwhile; a lane cannot, so it looks for a stop that came in between
        with signals_held():
            proc = subprocess.Popen(stage.argv, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env,
                                    start_new_session=True)  # signals come through this process (`stop_stages`)
            with _running_lock:
                _running.add(proc)
                missed = _stopped_by if in_lane else None
        if missed is not None:
            _stop_one(proc, missed, GRACE_S)
            raise Stopped(missed)
        with TreePeak(proc.pid) as peak:
            for line in proc.stdout:
                stage.output.append(line.rstrip("\n"))
                log.write(line)
            code = proc.wait()
        stage.peak_bytes = peak.bytes
    except BaseException as exc:  # stopped (errors.Stopped carries the signal) or broken: the stages stop too
        if proc is None:  # it never started (no such command): nothing to stop or to say
            raise
        stop_stages(getattr(exc, "signum", signal.SIGTERM))
        # say which stage was cut: its output is not written, and the same command runs it again
        kept = f"{stage.done} was not written" if stage.done is not None else "it wrote nothing to keep"
        line = (f"{prefix} {stage.name:9s} stopped after {time.time() - t0:.0f}s ({type(exc).__name__}: {exc}): "
                f"{kept}; the same command runs this stage again")
        print(line, flush=True)
        log.write(f"\n# {line}\n")
        raise
    finally:
        if proc is not None:
            with _running_lock:
                _running.discard(proc)
    stage.seconds = time.time() - t0
    if code not in stage.allowed_exit:
        stage.status = "failed"
        tail = "\n".join(stage.output[-15:])
        raise DFlashError(f"{prefix.strip('[]')} stage `{stage.name}` failed (exit {code}); its output:\n{tail}")
    stage.status = "ok"
    print(f"{prefix} {stage.name:9s} ok in {stage.seconds:.0f}s, {gib(stage.peak_bytes)} GiB of RAM at its peak",
          flush=True)
