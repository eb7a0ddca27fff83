"""Benchmark: the eval's batched decoding on the CPU with busy processes beside it, as in `dflash-train demo`,
where the side lanes (validate, to-zlab, serve dry run; on a GPU machine also the replay) run while the eval
decodes. Four runs of the same decoding, each in a fresh process with its OMP_NUM_THREADS:

  alone            every core, nothing beside it (the baseline of the ratios)
  beside           every core, with --busy processes spinning beside it (oversubscribed)
  capped, beside   every core but --busy, with them beside it (`demo.beside_the_eval` on many cores)
  capped, alone    every core but --busy, nothing beside it (what the cap costs once the lanes are done)

    python bench/bench_eval_threads.py [--draft runs/demo/drafter] [--prompts 4] [--max-new-tokens 64] [--busy 1]

Measured 2026-12-04 on 2 Zen 4 cores, the demo's drafter, 4 prompts x 64 tokens, through `dflash-train eval`
(one busy process): 7.2 s alone, 19.7 s beside, 7.1 s capped beside; 24 prompts: 40.1 s with 2 threads beside
the side lane's ~11 s, 70.6 s with 1 thread (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUSY = "while True: pass"


def decode(draft: str | None, prompts: int, max_new_tokens: int) -> dict:
    """One timed batched decoding in this process (after a one-prompt warm-up): seconds, new tokens."""
    import torch
    from bench_eval import models_and_prompts  # the sibling bench: this script's folder is on sys.path

    from dflash_train.eval.batched_decode import batched_speculative_generate

    model, target, rendered, eos = models_and_prompts(draft, prompts)
    block = model.config.block_size
    batched_speculative_generate(model, target, rendered[:1], 2, block_size=block, eos_token_ids=eos)  # warm-up
    t = time.perf_counter()
    out = batched_speculative_generate(model, target, rendered, max_new_tokens, block_size=block, eos_token_ids=eos)
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "new_tokens": sum(len(g.tokens) for g in out), "threads": torch.get_num_threads()}


def run(threads: int, busy: int, args) -> dict:
    """The decoding in a child process with `threads` OpenMP threads and `busy` spinning processes beside it."""
    spinners = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    try:
        cmd = [sys.executable, __file__, "--child", "--prompts", str(args.prompts),
               "--max-new-tokens", str(args.max_new_tokens), "--draft", args.draft or ""]  # "": a random drafter
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                             check=False)
        if out.returncode:
            raise SystemExit(f"the decoding failed ({threads} threads, {busy} beside):\n{out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    demo = ROOT / "runs" / "demo" / "drafter"
    ap.add_argument("--draft", default=str(demo) if (demo / "config.json").is_file() else None,
                    help="a drafter folder (default: the demo's when it was run, else a random 1-layer drafter)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--busy", type=int, default=None, help="processes beside the eval (default: 1 on up to 4 "
                    "cores, else 2, the GPU demo's two lanes)")
    ap.add_argument("--json", help="append the rows (one JSON line each) to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(decode(args.draft, args.prompts, args.max_new_tokens)))
        return
    from dflash_train.machine import usable_cores

    n = usable_cores()
    busy = args.busy if args.busy is not None else (1 if n <= 4 else 2)
    capped = max(1, n - busy)
    print(f"{n} cores, {busy} busy beside; drafter {args.draft or 'random'}; {args.prompts} prompts x "
          f"<= {args.max_new_tokens} new tokens")
    runs = [("alone", n, 0), ("beside", n, busy), ("capped, beside", capped, busy), ("capped, alone", capped, 0)]
    rows = []
    for name, threads, beside in runs:
        r = run(threads, beside, args)
        rows.append({"bench": "bench_eval_threads", "run": name, "threads": r["threads"], "busy": beside,
                     "cores": n, "seconds": r["seconds"], "new_tokens": r["new_tokens"]})
    base = rows[0]["seconds"]
    print("| run | threads | busy beside | seconds | / alone |\n|---|---|---|---|---|")
    for r in rows:
        r["ratio"] = r["seconds"] / base
        print(f"| {r['run']} | {r['threads']} | {r['busy']} | {r['seconds']:.2f} | {r['ratio']:.2f} |")
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
