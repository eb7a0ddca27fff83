"""Data generation at GPU speed (issue 14): regeneration new tokens/s and feature extraction tokens/s.

On the embedded SmolLM2 target and ShareGPT first exchanges, in one run:
  1. regeneration of the first --regen-rows conversations, this toolkit's HF path (`HFGenerator` as `regenerate --engine hf` builds it: on CUDA
     a static KV cache, decode steps replayed from a CUDA graph recorded per group (data/decode_graph.py),
     length-sorted groups sized to the free memory): a first pass (includes the recordings) and a timed second
     pass over the same conversations;
  2. regeneration, f25d61f's path for comparison: dynamic KV cache, eager, every conversation in one
     `generate` call on CUDA (at most 32 rows per call on CPU), and how many rows both paths agree on;
  2b. regeneration as 8275a25 ran it: (1), but greedy rows through transformers' `generate` with the static
     cache instead of data/static_decode.py's loop (`regen-generate`), against (1) the same way;
  2c. (1) with the loop's decode step eager (`regen-eager`): no compile to pay on the first pass, and no graph;
  2d. (1) with the decode step compiled (`regen-compiled`: inductor, "reduce-overhead", the default until
     2026-12-06): 103.5 s of a first pass on a cold H200 machine against 4.1 s for the second (304cfdf). Its
     second pass against (1)'s is what the recording gives up per step; its first pass what it saves;
  3. over every row (--feature-rows), `write_feature_cache` vs the plain target forward on the same batches (`measure_features` of
     bench_features.py): tokens/s, ratio, seconds the forward waited on the writer threads, GB per 1M tokens.
Eval steps/s is not measured here: dflash_train/eval is being changed for GPU decoding (issue 14 item 3).

Variants (`--list`): `regen` (1), `regen-f25d61f` (2), `regen-generate` (2b), `regen-eager` (2c), `regen-compiled` (2d)
and `features` (3). The rows are prepared once, then
each variant runs in its own subprocess under `--timeout`; every finished variant appends one JSON line
to `--json` at once and a failed one is a row with its error while the run goes on (bench/variants.py).
A regeneration variant also writes a row as each of its passes ends (`partial`: "pass 1 of 2"), so a
run cut by a deadline keeps the passes it finished.
When `regen` runs before a baseline in one call, the baseline's row says how many rows they agree on and
how much faster `regen` was.

    python bench/bench_gpu_data.py            # on a GPU: 512 rows x 320 new tokens, 1024 feature rows
    python bench/bench_gpu_data.py --variant regen --json rows.jsonl   # one variant (a device call each)
    python bench/bench_gpu_data.py --smoke    # the same code on CPU at a tiny size (< 2 min; the default
                                              # without a GPU, so `make bench` stays short)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_features import measure_features, sync  # noqa: E402 - the sibling bench, shared
from variants import add_arguments, answered, append_row, commit, run_all, run_child  # noqa: E402

VARIANTS = {"regen": "regeneration, this toolkit's HF path (static cache, decode steps from a recorded CUDA graph): "
                     "new tokens/s",
            "regen-f25d61f": "regeneration, f25d61f's HF path (dynamic cache, eager, one generate call)",
            "regen-generate": "regeneration, 8275a25's HF path (static cache, greedy rows through generate)",
            "regen-eager": "regeneration, this toolkit's HF path with the decode step eager (no compile to pay)",
            "regen-compiled": "regeneration, this toolkit's HF path with the decode step compiled (until 2026-12-06)",
            "features": "feature extraction (write_feature_cache) against the plain target forward: tokens/s"}


BASELINES = ("regen-f25d61f", "regen-generate", "regen-eager", "regen-compiled")  # each compared with `regen` when it ran first


def measure_regeneration(data: Path, rows: int, device: str, max_new_tokens: int, today: bool = False,
                         greedy_loop: bool = True, decode_step: str = "auto", each_pass=None) -> dict:
    """Two passes of `regenerate_batch` (the loop of `regenerate`) over the first `rows` conversations of `data`
    (`today`: f25d61f's path; `greedy_loop=False`: greedy rows through `generate`; `decode_step`: the loop's
    decode step, as `HFGenerator` takes it). `each_pass(row)` gets each pass's seconds and new tokens as it ends."""
    from dflash_train.data.hf_generate import HFGenerator
    from dflash_train.data.prepare import load_prepared, read_summary
    from dflash_train.data.regenerate import regenerate_batch, stop_ids
    from dflash_train.data.render import ChatRenderer
    from dflash_train.target import load_tokenizer, resolve_target

    max_length = int(read_summary(data)["inputs"]["max_length"])
    convs = [json.loads(m) for m in load_prepared(data)["messages"][:rows]]
    tok = load_tokenizer(None)
    renderer = ChatRenderer(tok, max_length=max_length)
    gen = HFGenerator(resolve_target(None), tok, stop_ids(tok, renderer), max_new_tokens, 0.0, device=device,
                      static_cache=False if today else None, greedy_loop=greedy_loop, decode_step=decode_step)
    if today:  # f25d61f: one generate call for the whole batch on CUDA, 32 rows per call on CPU
        gen.free_bytes = None
        gen.max_rows = len(convs) if device == "cuda" else 32
    passes, count = [], 1 if today else 2
    for _ in range(count):
        sync(device)
        t0 = time.perf_counter()
        out = regenerate_batch(convs, gen, renderer, max_length)
        sync(device)
        passes.append((time.perf_counter() - t0, sum(info["new_tokens"] for _, info in out)))
        if each_pass is not None:
            took, new = passes[-1]
            each_pass({"partial": f"pass {len(passes)} of {count}", "rows": len(convs), "seconds": took,
                       "new_tokens": new, "tok_s": new / took})
    seconds, new = passes[-1]
    prompts = [renderer.prompt_ids(c[:[m["role"] for m in c].index("assistant")]) for c in convs]
    return {"rows": len(convs), "new_tokens": new, "seconds": seconds, "tok_s": new / seconds,
            "first_s": passes[0][0], "messages": [m for m, _ in out],
            "groups": [(len(g), gen.width_of(max(len(prompts[i]) for i in g))) for g in gen.plan(prompts)]}


def _sha(message) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(message, sort_keys=True).encode()).hexdigest()[:12]


def _child(spec: dict) -> dict:
    """One variant in this process (the subprocess `run_child` starts)."""
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    device, data, work = spec["device"], Path(spec["data"]), Path(spec["work"])
    if spec["kind"] in ("regen", *BASELINES):
        def each_pass(row: dict) -> None:  # in the rows file at once: a part cut by its deadline keeps its passes
            append_row(spec.get("json"), {**spec.get("context", {}), "variant": spec["kind"], **row})

        r = measure_regeneration(data, spec["regen_rows"], device, spec["max_new_tokens"],
                                 today=spec["kind"] == "regen-f25d61f", greedy_loop=spec["kind"] != "regen-generate",
                                 decode_step={"regen-eager": "eager", "regen-compiled": "compiled"}.get(spec["kind"],
                                                                                                      "auto"),
                                 each_pass=each_pass)
        r["row_sha"] = [_sha(m) for m in r.pop("messages")]
        return r
    from dflash_train.features.cache import batch_tokens_that_fit, bytes_per_token
    from dflash_train.target import load_target

    cuda = device == "cuda"
    model, _ = load_target(None, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    batch_tokens = batch_tokens_that_fit(model.config, 5, torch.cuda.mem_get_info()[0]) if cuda else None
    f = measure_features(model, data, work, None if cuda else 8, 256, spec["repeats"], batch_tokens=batch_tokens)
    return {**f, "gb_per_1m_tokens": bytes_per_token(5 * model.config.hidden_size) * 1e6 / 1e9}


def _line(variant: str, r: dict, max_new_tokens: int) -> str:
    if "error" in r:
        return f"| {variant} | failed | {r['error']} |"
    if variant == "regen":
        return (f"| regeneration, HF path of this toolkit | {r['tok_s']:.0f} new | {r['rows']} rows x <= "
                f"{max_new_tokens} new tokens, {r['new_tokens']} generated in {r['seconds']:.1f} s (first pass, "
                f"which records the graphs on CUDA, {r['first_s']:.1f} s); groups (rows, width): {r['groups']} |")
    if variant in BASELINES:
        same = f"; identical rows {r['identical_rows']}/{r['rows']}" if "identical_rows" in r else ""
        speed = f"; this toolkit's path is {r['speedup']:.2f}x faster" if "speedup" in r else ""
        path = {"regen-f25d61f": "f25d61f's HF path", "regen-generate": "8275a25's HF path (greedy through generate)",
                "regen-eager": "this toolkit's HF path, decode step eager",
                "regen-compiled": "this toolkit's HF path, decode step compiled"}[variant]
        first = f" (first pass {r['first_s']:.1f} s)" if variant != "regen-f25d61f" else ""
        return f"| regeneration, {path} | {r['tok_s']:.0f} new | same rows, {r['seconds']:.1f} s{first}{speed}{same} |"
    return (f"| plain target forward | {r['plain_tok_s']:.0f} | {r['rows']} rows, {r['tokens']} tokens, "
            f"{r['batches']} batches (same batches as below) |\n"
            f"| feature extraction (write_feature_cache) | {r['cache_tok_s']:.0f} | ratio to the plain forward "
            f"{r['ratio']:.2f} (target >= 0.9 on GPU); forward waited {r['waited_s']:.2f} s on the writers; "
            f"{r['gb_per_1m_tokens']:.2f} GB per 1M tokens (5 layers) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: checks the bench runs (< 2 min)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one; cpu with --smoke)")
    ap.add_argument("--regen-rows", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--feature-rows", type=int, default=1024)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's; 1 with --smoke, "
                    "as tiny decoding steps run fastest on one thread of a shared machine)")
    add_arguments(ap, list(VARIANTS))
    args = ap.parse_args()
    if answered(args, VARIANTS, _child):
        return
    if not args.smoke and args.device is None and not torch.cuda.is_available():
        print("no CUDA GPU here: running --smoke (pass --device cpu for the full size on CPU, which takes hours)")
        args.smoke = True
    if args.smoke:
        args.device = args.device or "cpu"
        args.regen_rows, args.max_new_tokens, args.feature_rows, args.max_length, args.repeats = 6, 12, 8, 128, 1
        args.threads = args.threads or 1
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    import transformers

    from dflash_train.data.prepare import prepare_dataset

    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU, threads {args.threads or torch.get_num_threads()}"
    print(f"bench_gpu_data{' --smoke' if args.smoke else ''}: {name}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; SmolLM2-135M-Instruct ({'bf16' if device == 'cuda' else 'fp32'})")
    context = {"bench": "bench_gpu_data", "device": name, "torch": torch.__version__,
               "transformers": transformers.__version__, "commit": commit(), "smoke": args.smoke}
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-data-"))
    done: dict[str, dict] = {}
    try:
        # one set of first exchanges (a prepare reads the whole ShareGPT file): the first --regen-rows
        # conversations are regenerated, every row goes through the target for features
        prepare_dataset(None, args.data, work / "data", max_samples=max(args.regen_rows, args.feature_rows),
                        max_length=args.max_length, max_turns=1)
        base = {"device": device, "data": str(work / "data"), "work": str(work), "threads": args.threads,
                "regen_rows": args.regen_rows, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                "json": args.json, "context": context}

        def run_one(variant: str) -> dict:
            r = run_child(__file__, {**base, "kind": variant}, args.timeout)
            ours = done.get("regen") if variant in BASELINES else None
            if "error" not in r and ours and "error" not in ours:  # a baseline after `regen`: compare
                r["identical_rows"] = sum(a == b for a, b in zip(r["row_sha"], ours["row_sha"], strict=True))
                r["speedup"] = ours["tok_s"] / r["tok_s"]
            done[variant] = r
            return r

        print("| stage | tokens/s | notes |")
        print("|---|---|---|")
        rows = run_all(args.variant or list(VARIANTS), run_one, args.json, context,
                       lambda v, r: print(_line(v, r, args.max_new_tokens), flush=True))
        print("| eval steps/s | not measured | dflash_train/eval is changing for GPU decoding (issue 14 item 3) |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    failed = [r["variant"] for r in rows if "error" in r]
    if failed:
        print(f"\nfailed: {', '.join(failed)} (each is a row with its error{' in ' + args.json if args.json else ''})")
        sys.exit(1)


if __name__ == "__main__":
    main()
