"""Offline feature extraction throughput vs. a plain target forward on the same batches.

Prepares a small chat set with the embedded SmolLM2 target, then times, in the same run and
on the same batches (same rows, order and padding):
  1. the plain forward `model(input_ids, attention_mask)` (logits included),
  2. `write_feature_cache` (forward + layer capture + greedy tokens + shard writes + checksums).
Repeats are interleaved (plain, cache, plain, cache, ...) and the best of each is kept, so a
busy machine hurts both alike. Prints tokens/s of each, the ratio (target >= 0.85) and the peak
memory growth of the extraction (it should stay near one batch, not grow with the data).
`measure_features` is shared with bench_gpu_data.py (which runs it on a GPU).

`--dtypes` instead times `write_feature_cache` with the target computing in float32 and in
bfloat16 (`data.target_dtype`), interleaved on the same rows, and prints the speed ratio, how far
the bf16 features are from the fp32 ones, and how often the greedy tokens (the `greedy` labels)
agree with fp32's and with the data's next token.

`--teachers` instead times the cache the kl loss's teacher needs against the lean cache (`greedy=False`:
the forward stops after the deepest feature layer, no LM head) on the same rows, interleaved: the top 32
over the whole head (`objective.kl_teacher: target_vocab`) and over a 4,096-id draft vocabulary, the ids
most frequent in the rows' answers (`draft_vocab`), the latter also with the target's greedy tokens (the whole
head's argmax: `objective.labels: greedy`) and with them at the prompts' positions only (`objective.labels:
dataset` with `objective.positions: all`). It prints each one's tokens/s and time against the lean's.

    python bench/bench_features.py [--rows 64] [--max-length 256] [--batch-size 8] [--repeats 3] [--dtypes | --teachers]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure_features(model, data: Path, work: Path, batch_size: int | None, rows_per_shard: int, repeats: int,
                     batch_tokens: int | None = None, io_threads: int | None = None) -> dict:
    """Best-of-`repeats` tokens/s of the plain forward and of `write_feature_cache` on the same batches."""
    from dflash_train.data.prepare import load_prepared
    from dflash_train.features.cache import shard_batches, write_feature_cache
    from dflash_train.features.online import pad_right

    device = next(model.parameters()).device
    ds = load_prepared(data)
    rows = [torch.tensor(x, dtype=torch.long) for x in ds["input_ids"]]
    lengths = [len(r) for r in rows]
    n_tokens = sum(lengths)
    batches = []  # exactly the batches the cache writer forms
    for lo in range(0, len(rows), rows_per_shard):
        shard = lengths[lo: lo + rows_per_shard]
        batches += [pad_right([rows[lo + r] for r in idx]) for idx in shard_batches(shard, batch_size, batch_tokens)]

    def plain() -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            for ids, attn in batches:
                model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False)
        sync(device)
        return time.perf_counter() - t0

    waited = []

    def cache(k: int) -> float:
        out = work / f"cache-{k}"
        stats: dict = {}
        sync(device)
        t0 = time.perf_counter()
        write_feature_cache(None, data, out, batch_size=batch_size, rows_per_shard=rows_per_shard, model=model,
                            batch_tokens=batch_tokens, io_threads=io_threads, stats=stats)
        dt = time.perf_counter() - t0
        waited.append(stats["waited_s"])
        shutil.rmtree(out)
        return dt

    plain()  # warm-up
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t_plain, t_cache = [], []
    for k in range(repeats):
        t_plain.append(plain())
        t_cache.append(cache(k))
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    best = min(range(repeats), key=lambda k: t_cache[k])
    return {"rows": len(rows), "tokens": n_tokens, "batches": len(batches), "plain_tok_s": n_tokens / min(t_plain),
            "cache_tok_s": n_tokens / t_cache[best], "ratio": min(t_plain) / t_cache[best], "t_plain": t_plain,
            "t_cache": t_cache, "waited_s": waited[best], "rss_growth_mb": (rss1 - rss0) / 1024}


def compare_target_dtypes(data: Path, work: Path, batch_size: int, rows_per_shard: int, repeats: int) -> dict:
    """Best-of-`repeats` tokens/s of the cache writer with a float32 and a bfloat16 target (interleaved),
    the relative error of the bf16 features against fp32's, and greedy-token agreement at supervised positions."""
    from dflash_train.features.cache import FeatureCache, write_feature_cache
    from dflash_train.target import load_target

    models = {name: load_target(None, dtype=dtype)[0] for name, dtype in
              (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    times: dict[str, list[float]] = {name: [] for name in models}
    for k in range(repeats):
        for name, model in models.items():
            out = work / f"{name}-{k}"
            t0 = time.perf_counter()
            write_feature_cache(None, data, out, batch_size=batch_size, rows_per_shard=rows_per_shard, model=model)
            times[name].append(time.perf_counter() - t0)
    a, b = FeatureCache(work / "float32-0"), FeatureCache(work / "bfloat16-0")
    err = num = 0.0
    agree, data_agree, supervised = 0, {"float32": 0, "bfloat16": 0}, 0
    for i in range(len(a)):
        x, y = a.document(i), b.document(i)
        err += float((x.features.float() - y.features.float()).norm() ** 2)
        num += float(x.features.float().norm() ** 2)
        # position t predicts token t+1: the supervised next tokens are where loss_mask[t+1] is set
        nxt = x.loss_mask[1:].bool()
        supervised += int(nxt.sum())
        agree += int((x.greedy_next[:-1][nxt] == y.greedy_next[:-1][nxt]).sum())
        for name, doc in (("float32", x), ("bfloat16", y)):
            data_agree[name] += int((doc.greedy_next[:-1][nxt] == doc.input_ids[1:][nxt]).sum())
    tokens = a.manifest["num_tokens"]
    return {"tokens": tokens, "tok_s": {n: tokens / min(t) for n, t in times.items()},
            "ratio": min(times["float32"]) / min(times["bfloat16"]), "rel_err": (err / num) ** 0.5,
            "greedy_agree_fp32": agree / supervised,
            "greedy_is_data": {n: v / supervised for n, v in data_agree.items()}, "supervised": supervised}


def compare_teachers(data: Path, work: Path, batch_size: int, rows_per_shard: int, repeats: int,
                     draft_vocab: int = 4096, k: int = 32) -> dict:
    """Best-of-`repeats` seconds of the lean cache and of the top-k teachers' caches on the same rows."""
    from dflash_train.data.prepare import load_prepared
    from dflash_train.data.vocab import count_token_frequencies, reduced_vocab_maps
    from dflash_train.features.cache import write_feature_cache
    from dflash_train.target import load_target

    model, _ = load_target(None, dtype=torch.float32)
    ds = load_prepared(data)
    counts = count_token_frequencies(zip(ds["input_ids"], ds["loss_mask"], strict=True), model.config.vocab_size)
    vocab = reduced_vocab_maps(counts, draft_vocab)[1].nonzero().squeeze(1)
    kinds = {"lean": dict(greedy=False), "target_vocab": dict(topk=k),
             "draft_vocab": dict(topk=k, greedy=False, topk_vocab=vocab),
             # greedy labels (objective.labels: greedy) run the whole head at every position; dataset labels with
             # objective.positions: all at the prompts' positions only
             "draft_vocab_greedy": dict(topk=k, greedy=True, topk_vocab=vocab),
             "draft_vocab_prompts": dict(topk=k, greedy="prompts", topk_vocab=vocab)}
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for rep in range(repeats):
        for name, kw in kinds.items():
            t0 = time.perf_counter()
            write_feature_cache(None, data, work / f"{name}-{rep}", batch_size=batch_size,
                                rows_per_shard=rows_per_shard, model=model, **kw)
            times[name].append(time.perf_counter() - t0)
            shutil.rmtree(work / f"{name}-{rep}")
    best = {name: min(t) for name, t in times.items()}
    return {"tokens": sum(len(x) for x in ds["input_ids"]), "best_s": best, "times": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rows-per-shard", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--dtypes", action="store_true", help="compare a float32 and a bfloat16 target instead")
    ap.add_argument("--teachers", action="store_true",
                    help="time the kl teacher's caches (whole head, draft vocabulary) against the lean cache instead")
    ap.add_argument("--prepared", help="take --rows evenly spaced rows of this prepared folder (e.g. rows the "
                    "target regenerated) instead of preparing --data")
    args = ap.parse_args()
    from dflash_train.machine import describe, machine_facts

    print(f"machine: {describe(machine_facts())}")
    from dflash_train.data.prepare import prepare_dataset
    from dflash_train.target import load_target

    work = Path(tempfile.mkdtemp(prefix="bench-features-"))
    try:
        if args.prepared:
            from dflash_train.data.prepare import load_prepared

            ds = load_prepared(args.prepared)
            step = max(1, len(ds) // args.rows)
            ds.select(range(0, len(ds), step)[: args.rows]).save_to_disk(str(work / "data"))
        else:
            prepare_dataset(None, args.data, work / "data", max_samples=args.rows, max_length=args.max_length)
        if args.teachers:
            r = compare_teachers(work / "data", work, args.batch_size, args.rows_per_shard, args.repeats)
            lean = r["best_s"]["lean"]
            print(f"tokens {r['tokens']}  threads {torch.get_num_threads()}  float32 target, best of {args.repeats}")
            for name, t in r["best_s"].items():
                print(f"cache {name:18s} {r['tokens'] / t:8.1f} tok/s  {t:7.2f} s  {t / lean:.2f}x the lean cache's time")
            return
        if args.dtypes:
            r = compare_target_dtypes(work / "data", work, args.batch_size, args.rows_per_shard, args.repeats)
            print(f"tokens {r['tokens']}  threads {torch.get_num_threads()}  supervised positions {r['supervised']}")
            for name, v in r["tok_s"].items():
                print(f"features, target in {name:9s} {v:10.1f} tok/s")
            print(f"speed ratio bf16/fp32 {r['ratio']:.2f}x; bf16 features vs fp32: relative error {r['rel_err']:.4f}")
            print(f"greedy tokens: bf16 = fp32 at {r['greedy_agree_fp32']:.1%} of supervised positions; greedy = the "
                  f"data's next token: fp32 {r['greedy_is_data']['float32']:.1%}, bf16 {r['greedy_is_data']['bfloat16']:.1%}")
            return
        model, _ = load_target(None)
        r = measure_features(model, work / "data", work, args.batch_size, args.rows_per_shard, args.repeats)
        feat_mb = r["tokens"] * model.config.hidden_size * 5 * 2 / 2**20
        print(f"rows {r['rows']}  tokens {r['tokens']}  batches {r['batches']}  threads {torch.get_num_threads()}")
        print(f"plain target forward   {r['plain_tok_s']:10.1f} tok/s   (runs: {', '.join(f'{t:.2f}s' for t in r['t_plain'])})")
        print(f"offline extraction     {r['cache_tok_s']:10.1f} tok/s   (runs: {', '.join(f'{t:.2f}s' for t in r['t_cache'])})")
        print(f"ratio extraction/plain {r['ratio']:.3f}  (target >= 0.85) -> {'OK' if r['ratio'] >= 0.85 else 'BELOW TARGET'}")
        print(f"peak RSS growth during timed runs {r['rss_growth_mb']:.1f} MiB; "
              f"all features of the set would be {feat_mb:.1f} MiB in bf16")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
