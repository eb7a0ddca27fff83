"""Speculative decoding with a DFlash drafter and an HF target, batch size 1.

One step, with the last committed token x at position p:

    drafter: block [x, MASK x (B-1)] at p..p+B-1 against the context features of positions < p
             -> proposals d_1..d_{B-1} (slot k proposes the token at p+k)
    target:  one forward over [x, d_1..d_{B-1}] with its KV cache (hidden states on)
    accept:  greedy: the longest prefix where d_k == argmax; temperature T: d_k is kept with
             probability min(1, p_k(d_k) / q_k(d_k)), a rejection draws from norm(max(0, p_k - q_k))
    commit:  the accepted drafts plus one token from the target (the bonus, or the redraw)
    crop:    the target cache keeps positions <= p + a (target_cache.py rolls back every cache kind:
             key/value, sliding window, recurrent); the features of p..p+a join the drafter's
             context (`append_context`). The drafter never caches block keys, so its cache only grows
             with verified positions and needs no crop.

Both loops (`speculative_generate`, `plain_generate`) stop at an EOS id or `max_new_tokens`; a
block that crosses either is truncated and only the kept tokens count. `evaluate` runs both on
chat prompts and returns the report dict (see report.py for the statistics). A greedy run that times
nothing against plain decoding decodes all its prompts at once instead (batched_decode.py: the same tokens
and steps, the target's weights read once a step for every prompt).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from dflash_train.errors import ConfigError
from dflash_train.eval.batched_decode import batchable, batched_speculative_generate, greedy_accept, stop_index
from dflash_train.eval.results import Generation, PromptResult, Step
from dflash_train.features.extract import capture_layers
from dflash_train.greedy import greedy_ids
from dflash_train.target import cache_arg

# ---- sampling helpers ------------------------------------------------------------------------

def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """One token from [V] logits: argmax when temperature == 0, else a sample at `temperature`."""
    if temperature <= 0:
        return int(greedy_ids(logits))
    probs = _probs(logits, temperature).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


def _draft_probs(draft, draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[K, Vd] draft logits -> proposal distributions q over the TARGET vocab [K, V]."""
    q_draft = _probs(draft_logits, temperature)
    if draft.lm_head is None:
        return q_draft
    vocab = draft.config.vocab_size
    ids = draft.draft_to_target(torch.arange(q_draft.shape[-1], device=q_draft.device))
    q = q_draft.new_zeros(q_draft.shape[0], vocab)
    return q.index_copy_(1, ids, q_draft)


def _propose(draft, draft_logits: torch.Tensor, temperature: float, generator):
    """Draft tokens (target ids) for each slot, and q over the target vocab (None when greedy)."""
    if temperature <= 0:
        return draft.draft_to_target(greedy_ids(draft_logits)).tolist(), None
    q = _draft_probs(draft, draft_logits, temperature).cpu()
    return torch.multinomial(q, 1, generator=generator)[:, 0].tolist(), q


def _verify(proposals: list[int], q: torch.Tensor | None, target_logits: torch.Tensor,
            temperature: float, generator) -> tuple[int, int]:
    """(number of leading proposals accepted, the token the target adds after them)."""
    if temperature <= 0:
        return greedy_accept(proposals, greedy_ids(target_logits).tolist())
    p = _probs(target_logits, temperature).cpu()
    for k, tok in enumerate(proposals):
        ratio = p[k, tok] / q[k, tok]
        if torch.rand((), generator=generator) < ratio:  # accept with probability min(1, p/q)
            continue
        residual = (p[k] - q[k]).clamp(min=0)
        total = residual.sum()
        dist = residual / total if total > 0 else p[k]
        return k, int(torch.multinomial(dist, 1, generator=generator))
    return len(proposals), int(torch.multinomial(p[len(proposals)], 1, generator=generator))


# ---- target helpers ----------------------------------------------------------------------------

def _device(model) -> torch.device:
    return next(model.parameters()).device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _new_cache(target):
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


def check_block_size(draft, block_size: int | None) -> int:
    trained = draft.config.block_size
    b = trained if block_size is None else int(block_size)
    if b < 2 or b > trained:
        raise ConfigError(f"--block-size {b}: must be between 2 and the drafter's trained block_size {trained} "
                          "(a drafter cannot propose more slots than it was trained for)")
    return b


# ---- the two decoding loops ----------------------------------------------------------------

@torch.no_grad()
def speculative_generate(draft, target, prompt_ids: Sequence[int], max_new_tokens: int,
                         temperature: float = 0.0, block_size: int | None = None,
                         eos_token_ids: Iterable[int] = (), generator: torch.Generator | None = None) -> Generation:
    """Decode with `draft` proposing and `target` verifying; returns the new tokens and every step."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    b = check_block_size(draft, block_size)
    eos = set(eos_token_ids)
    layer_ids = draft.config.target_layer_ids
    mask_id = draft.config.mask_token_id
    device = _device(target)
    draft_device = draft.fc.weight.device
    _sync(device)
    start = time.perf_counter()

    # prefill: the prompt's features become the drafter's context; the first token comes from the target
    from dflash_train.eval.target_cache import TargetCache

    cache = TargetCache(target)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    with capture_layers(target, layer_ids) as cap:  # feature t = output of decoder layer t (extract.py)
        out = target(input_ids=ids, **cache_arg(target, cache.cache), use_cache=True)
    ctx = draft.new_cache()
    n_prompt = ids.shape[1]
    draft.append_context(ctx, cap.features().to(draft_device),
                         torch.arange(n_prompt, device=draft_device)[None])
    tokens = [_pick(out.logits[0, -1], temperature, generator)]
    steps: list[Step] = []
    block = torch.full((1, b), mask_id, dtype=torch.long, device=draft_device)

    while tokens[-1] not in eos and len(tokens) < max_new_tokens:
        p = n_prompt + len(tokens) - 1  # position of the last committed token
        block[0, 0] = tokens[-1]
        hidden = draft.forward_block(draft.embed(block), torch.tensor([p], device=draft_device), ctx)
        proposals, q = _propose(draft, draft.logits(hidden[0, 1:]), temperature, generator)

        verify = torch.tensor([[tokens[-1], *proposals]], dtype=torch.long, device=device)
        cache.before_verify()
        with capture_layers(target, layer_ids) as cap:
            out = target(input_ids=verify, **cache_arg(target, cache.cache), use_cache=True)
        a, extra = _verify(proposals, q, out.logits[0], temperature, generator)

        cache.keep(target, verify, a + 1)  # verified inputs: positions p .. p+a
        feats = cap.features()[:, : a + 1].to(draft_device)
        draft.append_context(ctx, feats, torch.arange(p, p + a + 1, device=draft_device)[None])

        new = [*proposals[:a], extra]
        keep = stop_index(new, eos, max_new_tokens - len(tokens))
        steps.append(Step(committed=keep, accepted=min(a, keep), position=p))
        tokens.extend(new[:keep])
    _sync(device)
    return Generation(tokens=tokens, seconds=time.perf_counter() - start, steps=steps)


@torch.no_grad()
def plain_generate(target, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                   eos_token_ids: Iterable[int] = (), generator: torch.Generator | None = None) -> Generation:
    """The reference: one target forward per token with the same cache and stopping rules."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    eos = set(eos_token_ids)
    device = _device(target)
    _sync(device)
    start = time.perf_counter()
    cache = _new_cache(target)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    out = target(input_ids=ids, **cache_arg(target, cache), use_cache=True)
    tokens = [_pick(out.logits[0, -1], temperature, generator)]
    while tokens[-1] not in eos and len(tokens) < max_new_tokens:
        out = target(input_ids=torch.tensor([[tokens[-1]]], device=device), **cache_arg(target, cache), use_cache=True)
        tokens.append(_pick(out.logits[0, -1], temperature, generator))
    _sync(device)
    return Generation(tokens=tokens, seconds=time.perf_counter() - start)


# ---- evaluation on chat prompts ------------------------------------------------------------

def eos_token_ids(target_model, tokenizer) -> list[int]:
    """EOS ids from the target's generation config and the tokenizer."""
    ids: set[int] = set()
    gen = getattr(target_model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return sorted(ids)


def _ensure_attached(draft, target_model) -> None:
    if draft._target_embed is None or (draft.lm_head is None and draft._target_lm_head is None):
        draft.attach_target(target_model)
    cfg = target_model.config.get_text_config() if hasattr(target_model.config, "get_text_config") else target_model.config
    draft.config.check_against_target(cfg, where="drafter config")


def evaluate(draft, target_model, tokenizer, prompts: list[list[dict]], max_new_tokens: int = 64,
             temperature: float = 0.0, block_size: int | None = None, seed: int = 0,
             measure_speedup: bool = True, progress: bool = False, teacher_forced: bool = True,
             sources: Sequence[str | None] | None = None) -> dict:
    """Speculative decoding over chat `prompts` (OpenAI message lists); returns the report dict.

    Each prompt keeps its user turns up to the first assistant turn and is rendered with the
    target's chat template plus the generation prompt. Greedy runs also decode plainly and check
    the outputs are identical (`lossless`); `speedup` is plain wall time / speculative wall time
    on the same prompts in this run (None when `measure_speedup` is False; a greedy run then
    checks losslessness against the teacher-forced forward's argmax instead). Greedy runs with
    `teacher_forced` also put the decoded sequences through the training forward
    (teacher_forced.py) under the report's `teacher_forced` key. `sources` labels each prompt
    with its source, for tau per source (`per_source`).
    """
    from dflash_train.eval.prompts import render_prompts

    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {temperature}")
    if not prompts:
        raise ConfigError("evaluate: no prompts given; pass at least one conversation")
    if sources is not None and len(sources) != len(prompts):
        raise ConfigError(f"evaluate: {len(sources)} source labels for {len(prompts)} prompts; pass one per prompt")
    b = check_block_size(draft, block_size)
    _ensure_attached(draft, target_model)
    rendered = render_prompts(tokenizer, prompts)
    was_training = draft.training  # the trainer calls us mid-run: give its model back as it was
    draft.eval()
    try:
        return _evaluate(draft, target_model, tokenizer, rendered, max_new_tokens, temperature, b, seed,
                         measure_speedup, progress, teacher_forced, sources)
    finally:
        draft.train(was_training)


def _evaluate(draft, target_model, tokenizer, rendered, max_new_tokens, temperature, b, seed,
              measure_speedup, progress, teacher_forced, sources) -> dict:
    from tqdm import tqdm

    from dflash_train.eval.report import build_report

    eos = eos_token_ids(target_model, tokenizer)
    greedy = temperature <= 0
    # greedy runs check losslessness against plain decoding, or without a speedup run against the
    # teacher-forced forward's argmax (the same greedy decoding, one forward per prompt instead of one per token)
    run_plain = measure_speedup or (greedy and not teacher_forced)

    if measure_speedup:  # warm-up: first forwards pay one-off allocation costs
        plain_generate(target_model, rendered[0], 2, 0.0, eos)
        speculative_generate(draft, target_model, rendered[0], 2, 0.0, b, eos)

    results = []
    batched = None
    if greedy and not run_plain and batchable(target_model):  # no timing to compare: every prompt's block
        # verified in one target forward (batched_decode.py)
        with tqdm(total=len(rendered), desc="spec-decode", unit="prompt", disable=not progress) as bar:
            batched = batched_speculative_generate(draft, target_model, rendered, max_new_tokens, b, eos,
                                                   on_done=bar.update)
    one_by_one = progress and batched is None
    for i, ids in enumerate(tqdm(rendered, desc="spec-decode", unit="prompt", disable=not one_by_one)):
        if batched is not None:
            spec = batched[i]
        else:
            gen_spec = torch.Generator().manual_seed(seed + i)
            spec = speculative_generate(draft, target_model, ids, max_new_tokens, temperature, b, eos, gen_spec)
        plain = None
        if run_plain:
            gen_plain = torch.Generator().manual_seed(seed + i)
            plain = plain_generate(target_model, ids, max_new_tokens, temperature, eos, gen_plain)
        results.append(PromptResult(index=i, prompt_tokens=len(ids), spec=spec, plain=plain,
                                    text=tokenizer.decode(spec.tokens, skip_special_tokens=False),
                                    source=sources[i] if sources is not None else None))
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "block_size": b,
                "lossless_check": "plain decode" if greedy and run_plain else None,
                "batched": batched is not None,
                "drafter_block_size": draft.config.block_size, "seed": seed, "measure_speedup": measure_speedup,
                "eos_token_ids": eos, "num_prompts": len(rendered),
                "target_layer_ids": draft.config.target_layer_ids,
                "reduced_vocab": draft.config.reduced_vocab}
    report = build_report(results, b, greedy=greedy, measure_speedup=measure_speedup, settings=settings)
    if greedy and teacher_forced:  # sampled steps accept by chance: no block-by-block counterpart
        from dflash_train.eval.teacher_forced import teacher_forced_report

        report["teacher_forced"] = teacher_forced_report(draft, target_model, rendered,
                                                         [r.spec for r in results], b)
        if not run_plain:
            from dflash_train.eval.report import lossless_from_teacher_forced

            lossless_from_teacher_forced(report)
    return report
