"""Offline feature extraction throughput vs. a plain target forward on the same batches.

Prepares a small chat set with the embedded SmolLM2 target, then times, in the same run and
on the same batches (same rows, order and padding):
  1. the plain forward `model(input_ids, attention_mask)` (logits included),
  2. `write_feature_cache` (forward + layer capture + greedy tokens + shard writes + checksums).
Repeats are interleaved (plain, cache, plain, cache, ...) and the best of each is kept, so a
busy machine hurts both alike. Prints tokens/s of each, the ratio (target >= 0.85) and the peak
memory growth of the extraction (it should stay near one batch, not grow with the data).

    python bench/bench_features.py [--rows 64] [--max-length 256] [--batch-size 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rows-per-shard", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", default="sharegpt")
    args = ap.parse_args()

    from dflash_train.data.prepare import load_prepared, prepare_dataset
    from dflash_train.features.cache import shard_batches, write_feature_cache
    from dflash_train.features.online import pad_right
    from dflash_train.features.target import load_target

    work = Path(tempfile.mkdtemp(prefix="bench-features-"))
    try:
        prepare_dataset(None, args.data, work / "data", max_samples=args.rows, max_length=args.max_length)
        ds = load_prepared(work / "data")
        model, _ = load_target(None)
        rows = [torch.tensor(x, dtype=torch.long) for x in ds["input_ids"]]
        lengths = [len(r) for r in rows]
        n_tokens = sum(lengths)
        batches = []  # exactly the batches the cache writer forms
        for lo in range(0, len(rows), args.rows_per_shard):
            shard = lengths[lo: lo + args.rows_per_shard]
            batches += [pad_right([rows[lo + r] for r in idx]) for idx in shard_batches(shard, args.batch_size)]

        def plain() -> float:
            t0 = time.perf_counter()
            with torch.no_grad():
                for ids, attn in batches:
                    model(input_ids=ids, attention_mask=attn, use_cache=False)
            return time.perf_counter() - t0

        def cache(k: int) -> float:
            out = work / f"cache-{k}"
            t0 = time.perf_counter()
            write_feature_cache(None, work / "data", out, batch_size=args.batch_size,
                                rows_per_shard=args.rows_per_shard, model=model)
            dt = time.perf_counter() - t0
            shutil.rmtree(out)
            return dt

        plain()  # warm-up
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t_plain, t_cache = [], []
        for k in range(args.repeats):
            t_plain.append(plain())
            t_cache.append(cache(k))
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tp, tc = n_tokens / min(t_plain), n_tokens / min(t_cache)
        ratio = tc / tp
        feat_mb = n_tokens * model.config.hidden_size * 5 * 2 / 2**20
        print(f"rows {len(rows)}  tokens {n_tokens}  batches {len(batches)}  threads {torch.get_num_threads()}")
        print(f"plain target forward   {tp:10.1f} tok/s   (runs: {', '.join(f'{t:.2f}s' for t in t_plain)})")
        print(f"offline extraction     {tc:10.1f} tok/s   (runs: {', '.join(f'{t:.2f}s' for t in t_cache)})")
        print(f"ratio extraction/plain {ratio:.3f}  (target >= 0.85) -> {'OK' if ratio >= 0.85 else 'BELOW TARGET'}")
        print(f"peak RSS growth during timed runs {(rss1 - rss0) / 1024:.1f} MiB; "
              f"all features of the set would be {feat_mb:.1f} MiB in bf16")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
