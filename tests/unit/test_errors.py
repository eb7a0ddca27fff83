"""run_cli: user errors become one line and exit code 2; bugs keep their traceback."""

from __future__ import annotations

import errno

import pytest

from dflash_train.errors import ConfigError, run_cli


def _raising(exc):
    def app():
        raise exc
    return app


def test_dflash_errors_are_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        run_cli(_raising(ConfigError("--set optim.lr: must be > 0")))
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: --set optim.lr: must be > 0\n"


@pytest.mark.parametrize("err, needle", [
    (errno.EACCES, "Permission denied; check its permissions"),
    (errno.ENOSPC, "No space left on device; free some space"),
    (errno.EISDIR, "Is a directory; give a file, not a folder"),
])
def test_os_errors_that_name_a_file_are_the_users(capsys, err, needle):
    import os

    exc = OSError(err, os.strerror(err), "/data/run/summary.json")
    with pytest.raises(SystemExit) as info:
        run_cli(_raising(exc))
    assert info.value.code == 2
    assert capsys.readouterr().err == f"error: /data/run/summary.json: {needle}\n"


def test_a_real_file_error_from_the_os(tmp_path, capsys):
    def app():
        (tmp_path / "a-file").write_text("x")
        open(tmp_path / "a-file" / "below")  # noqa: SIM115 - ENOTDIR raised by the OS itself

    with pytest.raises(SystemExit):
        run_cli(app)
    assert capsys.readouterr().err == (f"error: {tmp_path / 'a-file' / 'below'}: Not a directory; "
                                       "a part of the path is a file, not a folder\n")


@pytest.mark.parametrize("exc", [TypeError("bug"), OSError("socket closed"), KeyError("x")])
def test_bugs_and_nameless_os_errors_keep_their_traceback(exc):
    with pytest.raises(type(exc)):
        run_cli(_raising(exc))


SIGNALLED = """
import os, signal, sys, tempfile
from pathlib import Path
from dflash_train.errors import run_cli
if sys.argv[2] == "ignore":
    signal.signal(getattr(signal, sys.argv[1]), signal.SIG_IGN)  # as nohup leaves SIGHUP
scratch = Path(tempfile.mkdtemp(prefix=".tmp-signal-"))
def app():
    try:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        print("survived", flush=True)
    finally:
        scratch.rmdir()  # what a command's `finally` cleans up
        print("cleaned", flush=True)
run_cli(app)
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_stop_signal_runs_the_cleanups_and_ends_with_one_line(name):
    import signal
    import subprocess
    import sys

    def default_disposition():  # the caller's own: nohup or a shell's background job would leave it ignored
        signal.signal(getattr(signal, name), signal.SIG_DFL)

    done = subprocess.run([sys.executable, "-c", SIGNALLED, name, "handle"], capture_output=True, text=True,
                          timeout=60, preexec_fn=default_disposition)
    assert done.returncode == 128 + getattr(signal, name)
    assert done.stdout == "cleaned\n"
    assert done.stderr == (f"error: stopped by {name}; temporary files were removed (a resumable command continues "
                           "where it stopped when run again)\n")


def test_a_signal_the_caller_ignores_stays_ignored():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SIGNALLED, "SIGHUP", "ignore"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout == "survived\ncleaned\n", done.stderr
