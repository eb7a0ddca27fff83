"""Named bench variants, each in its own subprocess, each row saved the moment it is done.

The GPU machine gives a command 10 minutes, and a variant that runs out of memory, fails to compile or
hangs must not take the rows already measured with it. So a bench built on this module:
- lists its variants (`--list`) and runs the ones named (`--variant NAME`, repeatable; all by default),
- runs each in a subprocess under a wall-clock limit (`--timeout`, default 540 s),
- appends one JSON line per finished variant to `--json` at once (a failure is a row with its error,
  and the run goes on to the next variant).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_TIMEOUT_S = 540  # under the device's 10-minute command limit, with room to copy results back


def add_arguments(ap, names: list[str]) -> None:
    ap.add_argument("--list", action="store_true", help="print the variants and exit")
    ap.add_argument("--variant", action="append", choices=names, metavar="NAME",
                    help="run this variant (repeatable; default: all of them, in --list order)")
    ap.add_argument("--json", help="append one JSON line per finished variant to this file")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help=f"seconds one variant may run (default {DEFAULT_TIMEOUT_S})")
    ap.add_argument("--spec", help="internal: run one variant in this process from its JSON spec")


def answered(args, variants: dict[str, str], child: Callable[[dict], dict]) -> bool:
    """`--list` (print the variants) or `--spec` (run one variant here, print its JSON row): done, True.
    Otherwise False, and the bench runs its variants."""
    if args.list:
        print_list(variants)
        return True
    if args.spec:
        print(json.dumps(child(json.loads(args.spec))))
        return True
    return False


def print_list(variants: dict[str, str]) -> None:
    width = max(map(len, variants))
    for name, about in variants.items():
        print(f"{name:<{width}}  {about}")


def append_row(path: str | None, row: dict) -> None:
    """One JSON line, flushed to disk before the next variant starts."""
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def error_of(stderr: str) -> str:
    """The last line that names an exception (`SomethingError: message`), else the last line."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt")) or head.startswith("error"):
            return ln[:500]
    return (lines[-1] if lines else "no output")[:500]


def run_child(script: str, spec: dict, timeout: float, env: dict | None = None) -> dict:
    """Run `script --spec SPEC` and return the JSON object its last stdout line holds, or {"error": ...}."""
    t0 = time.perf_counter()
    # its own session, so a timeout ends the variant's own children too (the train row's dflash-train)
    proc = subprocess.Popen([sys.executable, script, "--spec", json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        return {"error": f"timed out after {timeout:g} s", "stderr_tail": (stderr or "")[-2000:]}
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if out.returncode == 0:
        try:
            return json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            return {"error": "no result line on stdout", "stderr_tail": out.stderr[-2000:]}
    err = "out of memory" if ("OutOfMemoryError" in out.stderr or "out of memory" in out.stderr) else \
        error_of(out.stderr)
    return {"error": err, "exit_code": out.returncode, "stderr_tail": out.stderr[-2000:],
            "wall_s": round(time.perf_counter() - t0, 1)}


def run_all(names: list[str], run_one: Callable[[str], dict], json_path: str | None, context: dict,
            show: Callable[[str, dict], None]) -> list[dict]:
    """Run the variants one after the other; each row = context + variant name + result, saved at once.
    An exception in `run_one` (in this process) is a row too."""
    rows = []
    for name in names:
        try:
            result = run_one(name)
        except Exception as exc:  # noqa: BLE001 - a failed variant is a row, the run goes on
            result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        row = {**context, "variant": name, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **result}
        append_row(json_path, row)
        show(name, row)
        rows.append(row)
    return rows


# `git archive` writes the commit into this file (.gitattributes: export-subst): a copy staged on a GPU machine
# as a tarball has no .git, and its bench rows still name the commit they measured
COMMIT_FILE = Path(__file__).resolve().parent / "COMMIT"


def commit() -> str | None:
    """The checkout's commit (git), else the one `git archive` stamped into bench/COMMIT, else None."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    stamped = COMMIT_FILE.read_text().strip() if COMMIT_FILE.is_file() else ""
    return stamped if stamped and not stamped.startswith("$Format") else None
