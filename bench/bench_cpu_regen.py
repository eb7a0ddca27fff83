"""Regeneration on a CPU without vLLM: new tokens/s of the HF paths `make demo` can fall back to.

Where pip has no wheel of vLLM's CPU build (macOS, Windows), `regenerate --engine auto` uses transformers'
`generate`. This times, on the first --rows conversations of a prepared source (the demo's own by default), one
path per run after a warm-up group:
  generate    `HFGenerator` as the CPU path builds it (dynamic cache, length-sorted groups of --group rows);
  static      the same with the static cache and data/static_decode.py's greedy loop, eager (the CUDA path's);
  continuous  transformers' continuous batching (`generate_batch`, `paged|sdpa` attention), its own batching.
It prints one JSON line: new tokens, seconds, new tokens/s and a hash of the rows (paths that agree token for
token print the same hash). Run each path in its own process, on an otherwise idle machine:

    python bench/bench_cpu_regen.py --path generate --dtype bfloat16
    python bench/bench_cpu_regen.py --path continuous --dtype float32 --rows 64

Measured on 2 Zen 4 cores: docs/results/2026-12-04-drafter-quality-round-19.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path


def demo_source(name: str) -> Path:
    """The prepared rows of one of the demo's sources in the data cache (run `make demo` once first)."""
    from dflash_train.data.prepare import read_summary
    from dflash_train.target import cache_dir

    for folder in sorted((cache_dir() / "data" / "sources").glob("*/prepared")):
        if read_summary(folder)["inputs"].get("source") == name:
            return folder
    raise SystemExit(f"no prepared {name} rows in the data cache: run `make demo` once, or give --data")


def continuous(model, prompts: list[list[int]], stops: list[int], max_new_tokens: int) -> list[list[int]]:
    from transformers import GenerationConfig

    model.set_attn_implementation("paged|sdpa")
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops, pad_token_id=0)
    out = model.generate_batch(inputs=prompts, generation_config=config)
    return [list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", choices=("generate", "static", "continuous"), default="generate")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--group", type=int, default=32, help="rows a group (generate, static)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--data", type=Path, default=None, help="a prepared dataset (default: the demo's chitchat rows)")
    args = ap.parse_args()

    from dflash_train.data.hf_generate import HFGenerator
    from dflash_train.data.prepare import load_prepared, read_summary
    from dflash_train.data.regenerate import regenerate_batch, stop_ids
    from dflash_train.data.render import ChatRenderer
    from dflash_train.target import load_tokenizer, resolve_target

    data = args.data or demo_source("chitchat")
    max_length = int(read_summary(data)["inputs"]["max_length"])
    convs = [json.loads(m) for m in load_prepared(data)["messages"][: args.rows]]
    tok = load_tokenizer(None)
    renderer = ChatRenderer(tok, max_length=max_length)
    stops = stop_ids(tok, renderer)
    gen = HFGenerator(resolve_target(None), tok, stops, args.max_new_tokens, 0.0, device="cpu",
                      static_cache=args.path == "static", dtype=args.dtype)
    gen.max_rows = args.group
    if args.path == "continuous":
        prompts = [renderer.prompt_ids(c[: [m["role"] for m in c].index("assistant")]) for c in convs]
        continuous(gen.model, prompts[:4], stops, 8)  # warm-up
        t0 = time.perf_counter()
        rows = [[t for t in row[: next((k for k, t in enumerate(row) if t in stops), len(row))]]
                for row in continuous(gen.model, prompts, stops, args.max_new_tokens)]
        seconds = time.perf_counter() - t0
        texts, new = [tok.decode(r, skip_special_tokens=True).strip() for r in rows], sum(map(len, rows))
    else:
        regenerate_batch(convs[:4], gen, renderer, max_length)  # warm-up
        t0 = time.perf_counter()
        out = regenerate_batch(convs, gen, renderer, max_length)
        seconds = time.perf_counter() - t0
        texts = [next(m["content"] for m in reversed(messages) if m["role"] == "assistant") for messages, _ in out]
        new = sum(info["new_tokens"] for _, info in out)
    print(json.dumps({"path": args.path, "dtype": args.dtype, "group": args.group, "rows": len(convs),
                      "new_tokens": new, "seconds": round(seconds, 1), "new_tok_s": round(new / seconds, 1),
                      "rows_sha": hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:10]}), flush=True)


if __name__ == "__main__":
    main()
