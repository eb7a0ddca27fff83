"""Online features: a micro-batch's documents in one padded target forward against groups of like lengths.

`data.features: online` (the 8B-class recipes) runs the target on each micro-batch's documents. Packed
first-fit from a shuffle, their lengths differ tenfold, and one right-padded batch computes every document
at the longest one's length. `DocumentSource` now runs them in groups of like lengths (`padded_groups`,
each forward priced at 1/8 of the rows' tokens or its launches' worth on a GPU). This bench prepares
ShareGPT first exchanges with the embedded SmolLM2 target's chat template, plans micro-batches exactly as
training does (`plan_microbatches`, `--tokens` a micro-batch: the 8B recipes' 3,072 by default), and times
both ways on the same micro-batches, interleaved (one padded batch, groups, one padded batch, ...), the best
of `--repeats` each. It prints, per micro-batch and in all: the rows' tokens, the positions each way
computes, its forwards and seconds, the ratio of the two, the two ways' largest relative difference of a
document's features (float rounding only) and how often their greedy tokens agree. One JSON line (`--json`)
holds the same.

    python bench/bench_online_features.py [--rows 400] [--microbatches 4] [--tokens 3072] [--repeats 2]
                                          [--device cpu|cuda] [--shape smollm2|qwen3-8b] [--json FILE]

On a CPU a forward costs its arithmetic, so the ratio follows the positions' ratio; on a GPU with the
135M target a forward is mostly kernel launches, which is why the GPU price keeps it to one forward there.
`--shape qwen3-8b` times a target of Qwen3-8B's shape with random weights instead (bf16, ~16 GB: a GPU's
bench; no 8B weights install offline), on the same token ids: the recipes that train online are 8B-class.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_source(source, idx: list[int]) -> tuple[float, dict, list]:
    """(seconds, {forwards, positions, tokens} of the target's padded forwards, the documents) of one
    micro-batch's documents."""
    device = next(source._extract.model.parameters()).device
    before = dict(source.forwards)
    sync(device)
    start = time.perf_counter()
    docs = source.get(idx)
    sync(device)
    return time.perf_counter() - start, {k: v - before.get(k, 0) for k, v in source.forwards.items()}, docs


def measure(model, rows, microbatches: list[list[int]], layer_ids: list[int], repeats: int) -> dict:
    from dflash_train.train.documents import DocumentSource

    one = DocumentSource(rows, "online", model, layer_ids)
    one.extra_call_tokens = float("inf")  # the way before: one padded forward a micro-batch
    grouped = DocumentSource(rows, "online", model, layer_ids)
    out = []
    for idx in microbatches:
        best = {"one": float("inf"), "grouped": float("inf")}
        counts, docs = {}, {}
        for _ in range(repeats):
            for name, source in (("one", one), ("grouped", grouped)):
                s, counts[name], docs[name] = time_source(source, idx)
                best[name] = min(best[name], s)
        diff = max(float((a.features.float() - b.features.float()).norm() / a.features.float().norm())
                   for a, b in zip(docs["one"], docs["grouped"], strict=True))
        greedy = sum(int((a.greedy_next == b.greedy_next).sum()) for a, b in zip(docs["one"], docs["grouped"],
                                                                                   strict=True))
        tokens = counts["one"]["tokens"]
        out.append({"rows": len(idx), "tokens": tokens,
                    "positions": {k: v["positions"] for k, v in counts.items()},
                    "forwards": {k: v["forwards"] for k, v in counts.items()}, "seconds": best,
                    "max_feature_diff": diff, "greedy_equal": greedy / tokens})
    return {"microbatches": out,
            "tokens": sum(m["tokens"] for m in out),
            "positions": {k: sum(m["positions"][k] for m in out) for k in ("one", "grouped")},
            "forwards": {k: sum(m["forwards"][k] for m in out) for k in ("one", "grouped")},
            "seconds": {k: sum(m["seconds"][k] for m in out) for k in ("one", "grouped")},
            "max_feature_diff": max(m["max_feature_diff"] for m in out),
            "greedy_equal": sum(m["greedy_equal"] * m["tokens"] for m in out) / sum(m["tokens"] for m in out)}


QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1_000_000.0, tie_word_embeddings=False)


def random_target(shape: str, dtype: torch.dtype, device: torch.device):
    """A causal LM of a named shape with random weights (timing only: its features mean nothing)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    if shape != "qwen3-8b":
        raise SystemExit(f"--shape {shape}: known shapes are smollm2 (the embedded target) and qwen3-8b")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_8B), dtype=dtype)
    return model.eval().requires_grad_(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=400, help="ShareGPT records prepared (the micro-batches' pool)")
    ap.add_argument("--max-length", type=int, default=3072)
    ap.add_argument("--tokens", type=int, default=3072, help="tokens a micro-batch (batch.tokens_per_microbatch)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", help="the target's dtype (auto: data.target_dtype's choice)")
    ap.add_argument("--shape", default="smollm2", help="smollm2 (the embedded target) or qwen3-8b (random weights)")
    ap.add_argument("--json", help="also write the result as one JSON line to this file")
    args = ap.parse_args()
    from dflash_train.data.packing import plan_microbatches
    from dflash_train.data.prepare import prepare_dataset
    from dflash_train.features.layer_ids import default_target_layer_ids
    from dflash_train.machine import auto_dtype, describe, machine_facts
    from dflash_train.target import load_target
    from dflash_train.train.documents import load_rows

    print(f"machine: {describe(machine_facts())}")
    work = Path(tempfile.mkdtemp(prefix="bench-online-"))
    try:
        prepare_dataset(None, "sharegpt", work / "rows", max_samples=args.rows, max_length=args.max_length)
        rows = load_rows(work / "rows")
        device = torch.device(args.device)
        dtype = getattr(torch, auto_dtype(device)[0] if args.dtype == "auto" else args.dtype)
        if args.shape == "smollm2":
            model, _ = load_target(None, dtype=dtype, device=str(device))
        else:
            model = random_target(args.shape, dtype, device)
        lengths = [len(x) for x in rows["input_ids"]]
        plan = plan_microbatches(lengths, args.tokens, seed=0, epoch=0)[: args.microbatches]
        layer_ids = default_target_layer_ids(model.config.num_hidden_layers, 5)
        r = measure(model, rows, plan, layer_ids, args.repeats)
        r.update(shape=args.shape, device=str(device), dtype=str(dtype).removeprefix("torch."), tokens_per_microbatch=args.tokens,
                 threads=torch.get_num_threads(), ratio=r["seconds"]["grouped"] / r["seconds"]["one"])
        # `make bench-gpu`'s table cell (bench_gpu_all.HEADLINE_KEYS): the rows' tokens/s in groups, the time ratio
        r.update(variant=f"online {args.shape}", tok_s=r["tokens"] / r["seconds"]["grouped"], time_ratio=r["ratio"])
        print(f"{args.shape}: {len(plan)} micro-batches of <= {args.tokens} tokens ({len(rows)} rows prepared), {device}, "
              f"{r['dtype']}, {r['threads']} threads, best of {args.repeats}")
        print("| micro-batch | rows | tokens | positions, one / groups | forwards | seconds, one / groups | ratio |")
        print("|---|---|---|---|---|---|---|")
        for k, m in enumerate(r["microbatches"]):
            p, s = m["positions"], m["seconds"]
            print(f"| {k} | {m['rows']} | {m['tokens']} | {p['one']} / {p['grouped']} | "
                  f"{m['forwards']['one']} / {m['forwards']['grouped']} | {s['one']:.2f} / {s['grouped']:.2f} | "
                  f"{s['grouped'] / s['one']:.2f}x |")
        p, s = r["positions"], r["seconds"]
        print(f"in all: positions {p['one'] / r['tokens']:.2f}x / {p['grouped'] / r['tokens']:.2f}x the rows' tokens, "
              f"forwards {r['forwards']['one']} / {r['forwards']['grouped']}, seconds {s['one']:.2f} / "
              f"{s['grouped']:.2f}: groups take {r['ratio']:.2f}x one padded forward's time")
        print(f"a document's features differ by at most {r['max_feature_diff']:.2e} (relative L2); greedy tokens "
              f"equal at {r['greedy_equal']:.2%}")
        if args.json:
            Path(args.json).write_text(json.dumps(r) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
