"""`make bench-gpu`: one command that measures a GPU machine under one deadline (issue 30, item 6).

Every GPU bench variant, the GPU tests and `make demo-gpu`, each part in its own process group under
its own timeout, cut to what is left of the deadline (default 540 s: 9 minutes). Each part appends one
JSON line to `--json` the moment it ends (status ok / failed / timeout / skipped, seconds, the bench
rows it wrote, its output's tail), so nothing measured is lost when a part fails or the deadline cuts
the run; a markdown table of every part ends the run (stdout and `--markdown`). Parts are run in the
order of the plan, the cheap and informative first; a part is skipped when less than `MIN_PART_S`
seconds of the deadline are left.

Usage: python bench/bench_gpu_all.py [--deadline 540] [--json runs/bench-gpu/parts.jsonl]
       [--markdown runs/bench-gpu/table.md] [--only NAME ...] [--list] [--plan FILE]
`--plan FILE`: a JSON list of {"name", "argv", "max_s"} in place of the default plan (tests use it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from variants import commit  # bench/ is on sys.path: the script's own folder

ROOT = Path(__file__).resolve().parents[1]
MIN_PART_S = 20  # a part given less than this would only report its start-up
PY = sys.executable
# the targets, before their baselines
FIRST_STEP_VARIANTS = ("flex-1", "flex-5", "train", "train-v8k", "train-all-slots")


def default_plan() -> list[dict]:
    """(name, argv, max seconds): the GPU tests first (minutes of nothing if the stack is broken), then
    the 5-minute demo, the data and head benches, then the training-step variants."""
    bench = str(ROOT / "bench")
    plan = [{"name": "gpu-tests", "argv": [PY, "-m", "pytest", "-m", "gpu", "tests/unit", "-q", "-p", "no:cacheprovider"],
             "max_s": 150},
            {"name": "demo-gpu", "argv": [str(Path(PY).parent / "dflash-train"), "demo", "--config",
                                          "recipes/smollm2-135m-demo-gpu.yaml", "--output", "runs/demo-gpu",
                                          "--num-prompts", "4", "--max-new-tokens", "128"], "max_s": 420},
            {"name": "eval-gpu", "argv": eval_on_the_gpu(), "max_s": 90},
            # the greedy loop (recorded decode steps), then the same loop compiled and eager and the path before it
            # in the same call: their rows say the ratios, the first passes and equal rows
            {"name": "regen", "argv": [PY, f"{bench}/bench_gpu_data.py", "--variant", "regen", "--variant",
                                       "regen-compiled", "--variant", "regen-eager", "--variant", "regen-generate",
                                       "--json", "{rows}"], "max_s": 300},
            {"name": "head", "argv": [PY, f"{bench}/bench_head.py"], "max_s": 90},
            # an 8B-class target's online features (random weights): one padded forward against groups of like lengths
            {"name": "online", "argv": [PY, f"{bench}/bench_online_features.py", "--device", "cuda", "--shape",
                                        "qwen3-8b", "--json", "{rows}"], "max_s": 150}]
    from bench_train_gpu import TRAIN_VARIANTS, VARIANTS  # the bench's own registry: a new variant joins the plan

    for v in sorted(VARIANTS, key=lambda v: (v not in FIRST_STEP_VARIANTS, FIRST_STEP_VARIANTS.index(v)
                                             if v in FIRST_STEP_VARIANTS else 0)):
        train = v in TRAIN_VARIANTS  # `dflash-train train` rows: optimizer steps, a longer part
        steps = ["--train-steps", "60"] if train else ["--steps", "10"]
        plan.append({"name": f"step:{v}", "argv": [PY, f"{bench}/bench_train_gpu.py", "--variant", v, *steps,
                                                   "--json", "{rows}"], "max_s": 230 if train else 150})
    return plan


def eval_on_the_gpu(out: str = "runs/demo-gpu", prompts: int = 4, new_tokens: int = 128) -> list[str]:
    """The demo-gpu part's eval stage run again on the GPU, into `eval-gpu.json` beside the demo's own (which
    decodes on the CPU): the same drafter, prompts and tokens, to say which device the demo's eval should use.
    A part, not a demo stage, until it is measured: it needs the demo-gpu part's drafter."""
    from dflash_train.demo import demo_stages

    folder = Path(out)
    eval_stage = next(s for s in demo_stages(folder, Path("recipe.yaml"), [], prompts, new_tokens) if s.name == "eval")
    mine = {str(folder / "eval.json"): str(folder / "eval-gpu.json"), str(folder / "eval.png"): str(folder / "eval-gpu.png")}
    return [mine.get(a, a) for a in eval_stage.argv] + ["--device", "cuda"]


# the demo table's rows a bench table shows (label in `dflash-train demo`'s table -> name in the cell)
DEMO_ROWS = {"tau": "tau (tokens per target forward)", "replayed": "tau replayed on every held-out row (± se)",
             "stages": "stage seconds"}


def headline(part: dict) -> str:
    """One cell for the table: the tests' closing line, the demo's tau, a bench row's key figures."""
    tail = part.get("tail", "")
    if part["status"] == "skipped":
        return part.get("why", "")
    demo = {label: key for key, label in DEMO_ROWS.items()}
    cells = {}
    for line in tail.splitlines():  # the demo's summary table: "│ what │ value │"
        parts = [p.strip() for p in line.split("│")]
        if len(parts) >= 3 and parts[1] in demo:
            cells[demo[parts[1]]] = parts[2]
    if cells:
        return "; ".join(f"{key} {value}" for key, value in cells.items())
    for line in reversed(tail.splitlines()):
        if " passed" in line or " failed" in line:
            return line.strip("= ").strip()
    lines = tail.strip().splitlines()
    if lines and PYTEST_DOTS.match(lines[-1]):  # pytest cut before its closing line: its progress characters
        dots = "".join(m[1] for m in map(PYTEST_DOTS.match, lines) if m)
        return f"{len(dots)} tests run before the cut, {dots.count('F') + dots.count('E')} failed or in error"
    if part.get("rows"):
        last: dict[str, dict] = {}  # each variant's last row: its own, or its last pass when it was cut
        for row in part["rows"]:
            last[row.get("variant", "")] = row
        cells = []
        for variant, row in last.items():
            figures = ", ".join(f"{k} {_figure(row[k])}" for k in HEADLINE_KEYS if k in row)
            cells.append(f"{variant}: {figures}" if variant and figures else figures or variant)
        return "; ".join(c for c in cells if c) or f"{len(part['rows'])} rows"
    return (lines or [""])[-1][:120]


HEADLINE_KEYS = ("partial", "step_ms", "step_s", "tokens_per_s", "new_tokens_per_s", "tok_s", "first_s", "peak_gib",
                 "bound_fraction", "time_ratio", "error")
PYTEST_DOTS = re.compile(r"^([.FEsxX]+)(\s+\[\s*\d+%\])?\s*$")  # a line of pytest -q's progress


def _figure(value) -> str:
    """A number as a table shows it: whole above 100, two decimals above 1, three significant digits below."""
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


PROGRESS = re.compile(r"^(?P<label>[^|\n]{0,60}?):?\s*\d+%\|")  # a progress bar's frame: "replay:  57%|█▋ | 62/108"


def readable_tail(out: str, chars: int = 3000) -> str:
    """The last `chars` of a part's output with each progress bar's frames cut to its last one: a cut part's
    tail would otherwise be its bar's last few hundred frames (the 2026-12-04 demo's), hiding the lines
    that say which stage it was in."""
    lines = []
    for raw in out.replace("\r\n", "\n").split("\n"):
        line = raw.rsplit("\r", 1)[-1]  # a terminal's in-place updates: the last one is what it showed
        bar = PROGRESS.match(line)
        if bar and lines and (last := PROGRESS.match(lines[-1])) and last["label"].strip() == bar["label"].strip():
            lines[-1] = line
        else:
            lines.append(line)
    return "\n".join(lines)[-chars:]


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`'s process group and every process below it, in its session or another: a bench's variant
    runs in a session of its own (bench/variants.py), so killing the part's process group alone left it running
    on the GPU into the next part (the 2026-12-04 `regen` part, cut, beside `step:flex-1`)."""
    from serve_shim.launch import descendants

    below = descendants(pid)  # before the group goes: then they are no longer below it
    for kill, target in [(os.killpg, pid), *((os.kill, child) for child in below)]:
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_part(part: dict, timeout: float) -> dict:
    """Run one part in its own process group; its bench rows come from a fresh `{rows}` file."""
    with tempfile.NamedTemporaryFile("w+", suffix=".jsonl", delete=False) as rows_file:
        rows_path = rows_file.name
    argv = [a.replace("{rows}", rows_path) for a in part["argv"]]
    t0 = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # the part's own children (a demo's stages, a bench's variants) too
        out, _ = proc.communicate()
        status = "timeout"
    text = Path(rows_path).read_text() if Path(rows_path).is_file() else ""
    Path(rows_path).unlink(missing_ok=True)
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if status == "ok" and any("error" in r for r in rows):
        status = "failed"
    return {"part": part["name"], "status": status, "exit_code": proc.returncode, "seconds": round(time.time() - t0, 1),
            "timeout_s": round(timeout, 1), "rows": rows, "tail": readable_tail(out or "")}


def run_plan(plan: list[dict], deadline_s: float, json_path: Path, markdown_path: Path) -> list[dict]:
    start, results = time.time(), []
    context = {"commit": commit(), "date": time.strftime("%Y-%m-%d", time.gmtime())}
    try:
        import torch

        context["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
    except ImportError:
        context["gpu"] = "unknown"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    for part in plan:
        left = deadline_s - (time.time() - start) - 5  # 5 s to write the last row and the table
        timeout = min(float(part["max_s"]), left)
        if left < MIN_PART_S:
            row = {"part": part["name"], "status": "skipped", "seconds": 0.0,
                   "why": f"{max(left, 0):.0f} s of the {deadline_s:g} s deadline left"}
        else:
            print(f"== {part['name']} (timeout {timeout:.0f} s)", flush=True)
            row = run_part(part, timeout)
        row = {**context, **row}
        with open(json_path, "a") as f:  # at once: a later part's failure or the deadline loses nothing
            f.write(json.dumps(row) + "\n")
        print(f"== {part['name']}: {row['status']} in {row['seconds']} s", flush=True)
        results.append(row)
    table = markdown(results, context, time.time() - start)
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(table)
    print(table)
    return results


def markdown(results: list[dict], context: dict, wall: float) -> str:
    lines = [f"GPU bench, {context['date']}, {context['gpu']}, commit {context['commit']}, {wall:.0f} s in all", "",
             "| part | status | seconds | result |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['part']} | {r['status']} | {r['seconds']} | {headline(r).replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadline", type=float, default=540, help="seconds for the whole run (default 540)")
    ap.add_argument("--json", default="runs/bench-gpu/parts.jsonl", help="one JSON line per finished part")
    ap.add_argument("--markdown", default="runs/bench-gpu/table.md", help="the table of every part")
    ap.add_argument("--only", action="append", metavar="NAME", help="run only these parts (repeatable)")
    ap.add_argument("--list", action="store_true", help="print the plan and exit")
    ap.add_argument("--plan", help="a JSON file: a list of {name, argv, max_s} instead of the default plan")
    args = ap.parse_args()
    plan = json.loads(Path(args.plan).read_text()) if args.plan else default_plan()
    if args.only:
        unknown = sorted(set(args.only) - {p["name"] for p in plan})
        if unknown:
            ap.error(f"--only {unknown[0]}: not a part; --list names them")
        plan = [p for p in plan if p["name"] in args.only]
    if args.list:
        for p in plan:
            print(f"{p['name']:<24} {p['max_s']:>4} s  {' '.join(p['argv'][1:])}")
        return
    run_plan(plan, args.deadline, Path(args.json), Path(args.markdown))


if __name__ == "__main__":
    main()
