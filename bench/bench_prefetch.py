"""The training loop with and without the prefetch thread (`engine.prefetch`), on the demo's own data: the time
of `dflash-train train`'s steps stage, `--steps` steps each, the two settings alternating `--repeats` times,
printed as a ratio (off against on). A CPU's answer decides `engine.prefetch: auto` (off on CPUs).

The runs read the demo's data and offline features from the data cache, so run `make demo` (or the demo's
data stage) first; the recipe's other settings are the demo's, with `--set` overrides passed through.

Usage: python bench/bench_prefetch.py [--steps 150] [--repeats 2] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "smollm2-135m-demo.yaml"


def steps_seconds(prefetch: bool, steps: int, sets: list[str], out: Path) -> float:
    """One `dflash-train train` run of `steps` steps (no checks, no eval); its steps stage in seconds."""
    shutil.rmtree(out, ignore_errors=True)
    overrides = [f"engine.prefetch={str(prefetch).lower()}", f"optim.max_steps={steps}", "logging.eval_every=1000000",
                 "logging.progress=false", "eval.enabled=false", "data.features=offline", *sets]
    cmd = [str(Path(sys.executable).with_name("dflash-train")), "train", "--config", str(RECIPE), "--output", str(out),
           *[a for o in overrides for a in ("--set", o)]]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"bench_prefetch: {' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    return float(json.loads((out / "summary.json").read_text())["stage_seconds"]["steps"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    args = ap.parse_args()
    times: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="bench-prefetch-") as tmp:
        for r in range(args.repeats):
            for mode in ("on", "off"):
                times[mode].append(steps_seconds(mode == "on", args.steps, args.sets, Path(tmp) / f"{mode}-{r}"))
                print(f"prefetch {mode:3s} run {r + 1}: {times[mode][-1]:.1f} s for {args.steps} steps", flush=True)
    on, off = statistics.mean(times["on"]), statistics.mean(times["off"])
    print(json.dumps({"steps": args.steps, "on_s": times["on"], "off_s": times["off"]}))
    print(f"steps stage: prefetch on {on:.1f} s, off {off:.1f} s: off takes {off / on:.2f}x the time of on")


if __name__ == "__main__":
    main()
