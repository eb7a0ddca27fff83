"""The LM head's eager epilogue on a CPU (what `objective.head: auto` runs there), against its maths before
2026-12-04, in the same run, at logits spread as a trained head's and as a fresh one's.

Before, the log-probabilities came from `torch.logsumexp` and the softmax from `exp(logits - lse)`: torch's CPU
exp takes a slow path where a result falls below the smallest normal float (an input under about -87), which a
trained head's log-probabilities over thousands of ids reach. Now `log_softmax` gives them and they are floored
at `head_epilogue.EXP_FLOOR` before exp. Prints ms per chunk for both and their ratio, and the largest
difference of the gradient between them (it must stay at the float32 rounding).

Usage: python bench/bench_cpu_epilogue.py [--rows 640] [--vocab 4096] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash_train.train import head_epilogue


def before(logits, ids, p, grad_dtype):
    """kl_chunk as it was: logsumexp, then exp of the shifted logits."""
    preds = logits.argmax(-1)
    lse = torch.logsumexp(logits, -1, keepdim=True)
    loss = (torch.xlogy(p, p) - p * (logits.gather(1, ids) - lse)).sum(-1)
    d = (logits - lse).exp_().mul_(p.sum(-1, keepdim=True)).scatter_add_(1, ids, -p)
    return loss, preds, d.to(grad_dtype)


def timed(fn, args, repeats: int) -> float:
    fn(*args)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=640, help="labelled positions in one chunk (the demo: ~640 a step)")
    ap.add_argument("--vocab", type=int, default=4096, help="draft ids (the demo: 4,096)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    from dflash_train.machine import describe, machine_facts

    print(f"machine: {describe(machine_facts())}, {torch.get_num_threads()} threads; kl epilogue over "
          f"[{args.rows}, {args.vocab}] fp32 logits, top-32 teacher, bf16 gradient")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.rows, 32), generator=g)
    p = torch.softmax(torch.randn(args.rows, 32, generator=g), -1)
    for std in (1.0, 8.0, 24.0):  # a fresh head's logits, then wider ones, as training spreads them
        logits = torch.randn(args.rows, args.vocab, generator=g) * std
        below = (torch.log_softmax(logits, -1) < head_epilogue.EXP_FLOOR).float().mean()
        t_before = timed(before, (logits, ids, p, torch.bfloat16), args.repeats)
        t_now = timed(head_epilogue.kl_chunk, (logits, ids, p, torch.bfloat16), args.repeats)
        diff = (before(logits, ids, p, torch.float32)[2] - head_epilogue.kl_chunk(logits, ids, p, torch.float32)[2])
        print(f"  logits std {std:4.1f} ({below:.0%} of log-probabilities below {head_epilogue.EXP_FLOOR:g}): before "
              f"{t_before:6.2f} ms, now {t_now:6.2f} ms, {t_now / t_before:.2f}x; gradient max diff "
              f"{diff.abs().max():.1e}")


if __name__ == "__main__":
    main()
