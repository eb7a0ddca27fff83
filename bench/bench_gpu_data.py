"""Data generation at GPU speed (issue 14): regeneration new tokens/s and feature extraction tokens/s.

On the embedded SmolLM2 target and ShareGPT first exchanges, in one run:
  1. regeneration of the first --regen-rows conversations, this toolkit's HF path (`HFGenerator` as `regenerate --engine hf` builds it: on CUDA
     a static KV cache, compiled decode steps, length-sorted groups sized to the free memory): a first
     pass (includes compiling) and a timed second pass over the same conversations;
  2. regeneration, f25d61f's path for comparison: dynamic KV cache, eager, every conversation in one
     `generate` call on CUDA (at most 32 rows per call on CPU), and how many rows both paths agree on;
  3. over every row (--feature-rows), `write_feature_cache` vs the plain target forward on the same batches (`measure_features` of
     bench_features.py): tokens/s, ratio, seconds the forward waited on the writer threads, GB per 1M tokens.
Eval steps/s is not measured here: dflash_train/eval is being changed for GPU decoding (issue 14 item 3).

    python bench/bench_gpu_data.py            # on a GPU: 512 rows x 320 new tokens, 1024 feature rows
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


def measure_regeneration(data: Path, rows: int, device: str, max_new_tokens: int, today: bool = False) -> dict:
    """Two passes of `regenerate_batch` (the loop of `regenerate`) over the first `rows` conversations of `data`."""
    from dflash_train.data.hf_generate import HFGenerator
    from dflash_train.data.prepare import load_prepared, read_summary
    from dflash_train.data.regenerate import regenerate_batch, stop_ids
    from dflash_train.data.render import ChatRenderer
    from dflash_train.features.target import load_tokenizer, resolve_target

    max_length = int(read_summary(data)["inputs"]["max_length"])
    convs = [json.loads(m) for m in load_prepared(data)["messages"][:rows]]
    tok = load_tokenizer(None)
    renderer = ChatRenderer(tok, max_length=max_length)
    gen = HFGenerator(resolve_target(None), tok, stop_ids(tok, renderer), max_new_tokens, 0.0, device=device,
                      static_cache=False if today else None)
    if today:  # f25d61f: one generate call for the whole batch on CUDA, 32 rows per call on CPU
        gen.free_bytes = None
        gen.max_rows = len(convs) if device == "cuda" else 32
    passes = []
    for _ in range(1 if today else 2):
        sync(device)
        t0 = time.perf_counter()
        out = regenerate_batch(convs, gen, renderer, max_length)
        sync(device)
        passes.append((time.perf_counter() - t0, sum(info["new_tokens"] for _, info in out)))
    seconds, new = passes[-1]
    prompts = [renderer.prompt_ids(c[:[m["role"] for m in c].index("assistant")]) for c in convs]
    return {"rows": len(convs), "new_tokens": new, "seconds": seconds, "tok_s": new / seconds,
            "first_s": passes[0][0], "messages": [m for m, _ in out],
            "groups": [(len(g), gen.width_of(max(len(prompts[i]) for i in g))) for g in gen.plan(prompts)]}


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
    args = ap.parse_args()
    if not args.smoke and args.device is None and not torch.cuda.is_available():
        print("no CUDA GPU here: running --smoke (pass --device cpu for the full size on CPU, which takes hours)")
        args.smoke = True
    if args.smoke:
        args.device = args.device or "cpu"
        args.regen_rows, args.max_new_tokens, args.feature_rows, args.max_length, args.repeats = 6, 12, 8, 128, 1
        args.threads = args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    import transformers

    from dflash_train.data.prepare import prepare_dataset
    from dflash_train.features.cache import batch_tokens_that_fit, bytes_per_token
    from dflash_train.features.target import load_target

    work = Path(tempfile.mkdtemp(prefix="bench-gpu-data-"))
    try:
        # one set of first exchanges (a prepare reads the whole ShareGPT file): the first --regen-rows
        # conversations are regenerated, every row goes through the target for features
        prepare_dataset(None, args.data, work / "data", max_samples=max(args.regen_rows, args.feature_rows),
                        max_length=args.max_length, max_turns=1)
        ours = measure_regeneration(work / "data", args.regen_rows, device, args.max_new_tokens)
        today = measure_regeneration(work / "data", args.regen_rows, device, args.max_new_tokens, today=True)
        same = sum(a == b for a, b in zip(ours["messages"], today["messages"], strict=True))

        cuda = device == "cuda"
        model, _ = load_target(None, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
        batch_size = None if cuda else 8
        batch_tokens = batch_tokens_that_fit(model.config, 5, torch.cuda.mem_get_info()[0]) if cuda else None
        f = measure_features(model, work / "data", work, batch_size, 256, args.repeats,
                             batch_tokens=batch_tokens)
        gb = bytes_per_token(5 * model.config.hidden_size) * 1e6 / 1e9

        name = torch.cuda.get_device_name() if cuda else f"CPU, threads {torch.get_num_threads()}"
        print(f"bench_gpu_data{' --smoke' if args.smoke else ''}: {name}; torch {torch.__version__}, "
              f"transformers {transformers.__version__}; SmolLM2-135M-Instruct ({'bf16' if cuda else 'fp32'})")
        print("| stage | tokens/s | notes |")
        print("|---|---|---|")
        print(f"| regeneration, HF path of this toolkit | {ours['tok_s']:.0f} new | {ours['rows']} rows x <= "
              f"{args.max_new_tokens} new tokens, {ours['new_tokens']} generated in {ours['seconds']:.1f} s (first "
              f"pass, which compiles on CUDA, {ours['first_s']:.1f} s); groups (rows, width): {ours['groups']} |")
        print(f"| regeneration, f25d61f's HF path | {today['tok_s']:.0f} new | same rows, {today['seconds']:.1f} s; "
              f"speedup {ours['tok_s'] / today['tok_s']:.2f}x; identical rows {same}/{ours['rows']} |")
        print(f"| plain target forward | {f['plain_tok_s']:.0f} | {f['rows']} rows, {f['tokens']} tokens, "
              f"{f['batches']} batches (same batches as below) |")
        print(f"| feature extraction (write_feature_cache) | {f['cache_tok_s']:.0f} | ratio to the plain forward "
              f"{f['ratio']:.2f} (target >= 0.9 on GPU); forward waited {f['waited_s']:.2f} s on the writers; "
              f"{gb:.2f} GB per 1M tokens (5 layers) |")
        print("| eval steps/s | not measured | dflash_train/eval is changing for GPU decoding (issue 14 item 3) |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
