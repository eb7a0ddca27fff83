"""Greedy speculative decoding of many prompts at once: the target verifies every row's block in one forward.

A verify forward of one row feeds B tokens through all of the target's weights; on a CPU (and a GPU at
batch 1) it is bound by reading those weights, not by the arithmetic. With R rows in one forward the weights
are read once for R blocks: on 2 CPU cores a SmolLM2 linear takes 0.57 ms for 8 tokens and 2.7 ms for 192.

The rows advance in lock step, one verify forward a step, each by its own number of accepted tokens:

- the target's cache is one DynamicCache for all rows and is never cropped. A block's rejected slots stay in
  it and are masked out of every later forward by the 2D attention mask; each token gets its true position
  through `position_ids`, so the holes change neither RoPE nor which positions a token attends to. Prompts are
  left-padded the same way (masked, positions from 0): each is prefilled alone and its keys and values
  right-aligned in the batch's cache, so the prefill computes no padding.
- the drafter runs row by row on its own context cache, exactly as in `speculative_generate` (it is small;
  its context needs no mask).
- a row that reaches EOS or `max_new_tokens` leaves the batch (`batch_select_indices`).

Each row's tokens and steps are those of `speculative_generate`'s greedy loop on that prompt alone (tested),
up to the rounding of a batched forward. Only plain key/value caches (`batchable`); sliding-window and
recurrent targets keep the one-row loop, whose cache crops and restores them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch

from dflash_train.eval.results import Generation, Step
from dflash_train.features.extract import capture_layers
from dflash_train.greedy import greedy_ids
from dflash_train.target import cache_arg


def batchable(target) -> bool:
    """Whether every layer of the target's cache is a plain, growing key/value layer (holes can be masked)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=target.config).layers)


def greedy_accept(proposals: Sequence[int], greedy: Sequence[int]) -> tuple[int, int]:
    """(leading proposals equal to the target's argmax, the argmax after them): a greedy verify step."""
    a = 0
    while a < len(proposals) and proposals[a] == greedy[a]:
        a += 1
    return a, greedy[a]


def stop_index(tokens: list[int], eos: set[int], room: int) -> int:
    """How many of `tokens` to keep: up to and including the first EOS, at most `room`."""
    n = min(len(tokens), room)
    for i in range(n):
        if tokens[i] in eos:
            return i + 1
    return n


class _Row:
    """One prompt's decoding state: its drafter context, tokens and steps."""

    def __init__(self, draft, prompt_len: int, first: int):
        self.ctx = draft.new_cache()
        self.prompt_len = prompt_len
        self.tokens = [first]
        self.steps: list[Step] = []

    @property
    def position(self) -> int:
        return self.prompt_len + len(self.tokens) - 1  # of the last committed token

    def done(self, eos: set[int], max_new_tokens: int) -> bool:
        return self.tokens[-1] in eos or len(self.tokens) >= max_new_tokens


def batched_speculative_generate(draft, target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                                 block_size: int, eos_token_ids: Iterable[int] = (),
                                 on_done: Callable[[int], None] | None = None) -> list[Generation]:
    """Greedy speculative decoding of every prompt; one Generation per prompt, in order. Its `seconds` is the
    batch's wall time shared out by the row's verify forwards. `on_done(n)`: n more rows have finished.
    The verify forwards attend on the target's stored K/V heads (data/gqa_decode.py: transformers' SDPA copies
    them `groups` times for a masked query of more than one token; SmolLM2's step 0.71x on 2 CPU cores)."""
    from dflash_train.data.gqa_decode import folded_gqa

    with folded_gqa(target):
        return _generate(draft, target, prompts, max_new_tokens, block_size, eos_token_ids, on_done)


@torch.no_grad()
def _generate(draft, target, prompts, max_new_tokens, block_size, eos_token_ids, on_done) -> list[Generation]:
    from transformers import DynamicCache

    eos, b = set(eos_token_ids), block_size
    layer_ids, mask_id = draft.config.target_layer_ids, draft.config.mask_token_id
    device, draft_device = next(target.parameters()).device, draft.fc.weight.device
    start = time.perf_counter()

    # prefill: each prompt alone (one padded batch computed every prompt at the longest one's length: 7,896
    # tokens for the demo's 1,568), its cache then right-aligned in one left-padded cache, positions from 0
    width = max(len(p) for p in prompts)
    attn = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    rows, layers = [], None  # layers: the batch's (keys, values) per layer, filled prompt by prompt
    for r, p in enumerate(prompts):
        alone = DynamicCache(config=target.config)
        with capture_layers(target, layer_ids) as cap:
            out = target(input_ids=torch.tensor([list(p)], device=device), **cache_arg(target, alone), use_cache=True,
                         logits_to_keep=1)
        row = _Row(draft, len(p), int(greedy_ids(out.logits[0, -1])))
        draft.append_context(row.ctx, cap.features().to(draft_device), torch.arange(len(p), device=draft_device)[None])
        rows.append(row)
        attn[r, width - len(p):] = 1
        if layers is None:
            layers = [tuple(t.new_zeros(len(prompts), *t.shape[1:-2], width, t.shape[-1]) for t in (a.keys, a.values))
                      for a in alone.layers]
        for (keys, values), a in zip(layers, alone.layers, strict=True):
            keys[r, ..., width - len(p):, :], values[r, ..., width - len(p):, :] = a.keys[0], a.values[0]
    cache = DynamicCache(config=target.config)
    for i, (keys, values) in enumerate(layers):
        cache.update(keys, values, i)
    live = [r for r in range(len(rows)) if not rows[r].done(eos, max_new_tokens)]
    if on_done:
        on_done(len(rows) - len(live))
    if len(live) < len(rows):
        cache.batch_select_indices(torch.tensor(live, dtype=torch.long, device=device))
        attn = attn[live]
    block = torch.full((1, b), mask_id, dtype=torch.long, device=draft_device)

    while live:
        verify, positions = [], []
        for r in live:  # the drafter, row by row
            row = rows[r]
            block[0, 0] = row.tokens[-1]
            hidden = draft.forward_block(draft.embed(block), torch.tensor([row.position], device=draft_device),
                                         row.ctx)
            proposals = draft.draft_to_target(greedy_ids(draft.logits(hidden[0, 1:]))).tolist()
            verify.append([row.tokens[-1], *proposals])
            positions.append(list(range(row.position, row.position + b)))
        attn = torch.cat([attn, attn.new_ones(len(live), b)], dim=-1)
        with capture_layers(target, layer_ids) as cap:
            out = target(input_ids=torch.tensor(verify, device=device), attention_mask=attn,
                         position_ids=torch.tensor(positions, device=device), **cache_arg(target, cache),
                         use_cache=True)
        greedy, feats = greedy_ids(out.logits).tolist(), cap.features()
        stay = []
        for i, r in enumerate(live):
            row, proposals = rows[r], verify[i][1:]
            a, extra = greedy_accept(proposals, greedy[i])
            attn[i, attn.shape[1] - b + a + 1:] = 0  # the rejected slots: holes from now on
            p = row.position
            draft.append_context(row.ctx, feats[i:i + 1, : a + 1].to(draft_device),
                                 torch.arange(p, p + a + 1, device=draft_device)[None])
            new = [*proposals[:a], extra]
            keep = stop_index(new, eos, max_new_tokens - len(row.tokens))
            row.steps.append(Step(committed=keep, accepted=min(a, keep), position=p))
            row.tokens.extend(new[:keep])
            if not row.done(eos, max_new_tokens):
                stay.append(i)
        if on_done:
            on_done(len(live) - len(stay))
        if len(stay) < len(live):
            index = torch.tensor(stay, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            attn = attn[index]
            live = [live[i] for i in stay]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds, total = time.perf_counter() - start, max(1, sum(len(row.steps) for row in rows))
    return [Generation(tokens=row.tokens, seconds=seconds * max(1, len(row.steps)) / total, steps=row.steps)
            for row in rows]
