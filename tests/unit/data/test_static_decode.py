"""data/static_decode.py: the static-cache greedy loop gives plain greedy `generate`'s tokens on the real SmolLM2
(left-padded rows that stop at different steps), reads the device only every CHECK_EVERY steps, and compiles
its decode step only where `generate` would."""

from __future__ import annotations

import pytest
import torch

from dflash_train.data import static_decode
from dflash_train.data.hf_generate import HFGenerator
from dflash_train.target import cache_kwarg

NEW = 40
STOP = [2]
pytestmark = pytest.mark.usefixtures("one_thread_module")  # small-batch decoding, fixtures too


def _plain(model, prompt):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=2)[0, len(prompt):]
    ids = out.tolist()
    return ids[: ids.index(2) + 1] if 2 in ids else ids


def _group(prompts, width, pad=2):
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    return ids, mask


def test_left_padded_rows_decode_to_plain_greedy_tokens_and_stop_at_a_check(smollm2, stopping_prompts, monkeypatch):
    from transformers import StaticCache

    model, _ = smollm2
    reference = [_plain(model, p) for p in stopping_prompts]
    ends = [len(r) for r in reference]
    assert min(ends) < max(ends) <= NEW  # rows stop at different steps, every one before NEW tokens
    width = max(len(p) for p in stopping_prompts) + 3  # every row left-padded
    ids, mask = _group(stopping_prompts, width)
    calls = []

    def step(**kw):
        calls.append(kw["position_ids"][:, 0].tolist())
        return model(**kw)

    reads = []
    real_all = torch.Tensor.all

    def counted_all(self, *a, **k):
        reads.append(1)
        return real_all(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "all", counted_all)
    cache = StaticCache(config=model.config, max_cache_len=width + NEW)
    tokens = static_decode.greedy_decode(model, step, ids, mask, cache, NEW, STOP, 2).tolist()
    monkeypatch.undo()
    for row, ref in zip(tokens, reference, strict=True):
        assert row[: len(ref)] == ref  # the same tokens to the stop
        assert all(t == 2 for t in row[len(ref):])  # a finished row writes padding after its stop
    # every row had stopped by step max(ends): the loop ends at the next check, no later
    every = static_decode.CHECK_EVERY
    assert len(tokens[0]) == min(NEW, -(-max(ends) // every) * every)
    assert len(calls) == len(tokens[0]) - 1  # one decode step per token after the prefill's
    assert len(reads) == len(tokens[0]) // every  # the device is read once per CHECK_EVERY steps
    lengths = mask.sum(-1).tolist()
    assert calls[0] == lengths and calls[5] == [n + 5 for n in lengths]  # each row's own positions


def test_the_decode_step_compiles_where_generate_would(smollm2):
    from transformers import CompileConfig

    model, _ = smollm2
    assert static_decode.compiled_forward(model, None, "cpu") == model.__call__  # eager on a CPU, as generate
    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    assert static_decode.compiled_forward(model, config, "cpu") is model.get_compiled_call(config)


def test_sampling_keeps_generate(smollm2_path, smollm2, stopping_prompts, monkeypatch):
    """Temperature > 0 goes through `generate` with the static cache; greedy never calls it, unless asked to."""
    gen = HFGenerator(str(smollm2_path), smollm2[1], STOP, 4, 0.7, static_cache=True)
    used = []
    real = gen.model.generate
    name = cache_kwarg(gen.model)
    monkeypatch.setattr(gen.model, "generate", lambda **kw: used.append(kw[name]) or real(**kw))
    assert len(gen.generate(stopping_prompts[:2], seed=1)) == 2 and len(used) == 1 and used[0] is not None
    greedy = HFGenerator(str(smollm2_path), smollm2[1], STOP, 4, 0.0, static_cache=True)
    monkeypatch.setattr(greedy.model, "generate", lambda **kw: pytest.fail("greedy rows went through generate"))
    looped = greedy.generate(stopping_prompts[:2])
    assert len(looped) == 2
    # the bench's baseline (`regen-generate`): greedy rows through generate, the same answers
    through = HFGenerator(str(smollm2_path), smollm2[1], STOP, 4, 0.0, static_cache=True, greedy_loop=False)
    used.clear()
    real = through.model.generate
    monkeypatch.setattr(through.model, "generate", lambda **kw: used.append(kw[name]) or real(**kw))
    assert through.generate(stopping_prompts[:2]) == looped and len(used) == 1


def test_finished_rows_leave_the_batch_when_it_shrinks(smollm2, stopping_prompts):
    """`shrink` (the CPU's loop): at a check where at least a quarter of the decoding rows have finished, they
    leave the batch and the cache; every row still gets plain greedy generate's tokens, in its own row."""
    from transformers import StaticCache

    model, _ = smollm2
    reference = [_plain(model, p) for p in stopping_prompts]
    ends = sorted(len(r) for r in reference)
    every = static_decode.CHECK_EVERY
    assert ends[0] < every < ends[-1]  # one row stops before the first check, one decodes past it
    width = max(len(p) for p in stopping_prompts)
    ids, mask = _group(stopping_prompts, width)
    rows_seen = []

    def step(**kw):
        rows_seen.append(kw["input_ids"].shape[0])
        assert kw["attention_mask"].shape[0] == kw["position_ids"].shape[0] == rows_seen[-1]
        return model(**kw)

    cache = StaticCache(config=model.config, max_cache_len=width + NEW)
    tokens = static_decode.greedy_decode(model, step, ids, mask, cache, NEW, STOP, 2, shrink=True).tolist()
    for row, ref in zip(tokens, reference, strict=True):
        assert row[: len(ref)] == ref and all(t == 2 for t in row[len(ref):])
    finished_at_check = sum(e <= every for e in ends)  # rows whose stop token came by the first check
    assert 4 * finished_at_check >= len(stopping_prompts)
    assert rows_seen[: every - 1] == [len(stopping_prompts)] * (every - 1)  # all rows until the first check...
    assert rows_seen[every - 1] == len(stopping_prompts) - finished_at_check  # ...then only those still decoding
    assert cache.layers[0].keys.shape[0] == min(rows_seen) < len(stopping_prompts)  # the cache shrank with them
