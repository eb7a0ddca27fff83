"""Benchmark: speculative decoding of N chat prompts one at a time (`speculative_generate`, what `eval` with the
speedup runs) against all at once (`batched_speculative_generate`, what `eval --no-speedup` runs), on the
embedded SmolLM2 target in fp32, in the same process: wall times, their ratio, and whether every prompt got the
same tokens and steps both ways.

The drafter is `--draft DIR` (a trained one accepts drafts, so its rows finish at different steps), or a
random 1-layer B=8 drafter (it accepts nothing: one token a verify forward).

    python bench/bench_eval.py [--draft runs/demo/drafter] [--prompts 8] [--max-new-tokens 32]

Measured 2026-11-28 on 2 AVX2 cores with the demo's drafter, 24 prompts x 64 tokens: 170.6 s against 50.3 s,
3.39x, 24 of 24 identical (docs/results/2026-11-28-weight-averaging-and-a-batched-eval.md).
"""

from __future__ import annotations

import argparse
import time

import torch

QUESTIONS = ["Tell me about the moon.", "Write a haiku about rain.", "What is 17 times 23? Explain.",
             "hi there, how are you doing today?", "Give me three tips for learning Python.",
             "Summarize the plot of Hamlet in two sentences.", "What's the capital of France and why is it famous?",
             "Explain recursion to a child."]


def models_and_prompts(draft_dir: str | None, count: int):
    """(drafter attached to the target, target, `count` rendered chat prompts, EOS ids): the embedded target in
    fp32 on the CPU and the drafter of `draft_dir`, or a random 1-layer B=8 one (it accepts nothing)."""
    from dflash_train.eval.prompts import render_prompts
    from dflash_train.eval.spec_decode import eos_token_ids
    from dflash_train.model.checkpoint import load_drafter
    from dflash_train.model.config import DFlashConfig
    from dflash_train.model.modeling_dflash import DFlashDraftModel
    from dflash_train.target import load_target, resolve_target

    target, tokenizer = load_target(resolve_target(None), dtype=torch.float32, device="cpu")
    if draft_dir:
        draft = load_drafter(draft_dir, target_config=target.config, tokenizer=tokenizer, what="--draft")
    else:
        draft = DFlashDraftModel(DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=8,
                                                         mask_token_id=16, dtype="float32"))
        draft.init_weights(seed=0)
    draft.eval().attach_target(target)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]
    prompts = render_prompts(tokenizer, [[{"role": "user", "content": q}] for q in questions])
    return draft, target, prompts, eos_token_ids(target, tokenizer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default=None, help="a drafter folder (default: a random drafter)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()

    from dflash_train.eval.batched_decode import batched_speculative_generate
    from dflash_train.eval.spec_decode import speculative_generate

    draft, target, prompts, eos = models_and_prompts(args.draft, args.prompts)
    b = draft.config.block_size
    speculative_generate(draft, target, prompts[0], 2, block_size=b, eos_token_ids=eos)  # warm-up

    t = time.perf_counter()
    alone = [speculative_generate(draft, target, p, args.max_new_tokens, block_size=b, eos_token_ids=eos)
             for p in prompts]
    one_s = time.perf_counter() - t
    t = time.perf_counter()
    together = batched_speculative_generate(draft, target, prompts, args.max_new_tokens, b, eos)
    all_s = time.perf_counter() - t

    def steps(g):
        return [(s.committed, s.accepted, s.position) for s in g.steps]

    same = sum(a.tokens == c.tokens and steps(a) == steps(c) for a, c in zip(alone, together, strict=True))
    forwards = sum(len(g.steps) for g in alone)
    tokens = sum(len(g.tokens) for g in alone)
    print(f"{args.prompts} prompts, {tokens} new tokens, {forwards} verify forwards one at a time, "
          f"tau {tokens / max(1, forwards):.3f} ({'--draft ' + args.draft if args.draft else 'random drafter'})")
    print(f"one at a time: {one_s:.1f} s; all at once: {all_s:.1f} s; ratio {one_s / all_s:.2f}x; "
          f"identical tokens and steps: {same} of {len(prompts)}")


if __name__ == "__main__":
    main()
