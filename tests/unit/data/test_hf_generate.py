"""HF regeneration: memory plan, length-sorted groups, and the CUDA path (static KV cache, greedy loop,
ladder widths, padded groups, out-of-memory split) run on CPU against plain per-prompt generate."""

from __future__ import annotations

import pytest
import torch

from dflash_train.data import hf_generate as hg
from dflash_train.data import static_decode
from dflash_train.errors import DataError

NEW = 6
STOP = [2]
pytestmark = pytest.mark.usefixtures("one_thread_module")  # small-batch decoding, fixtures too


def test_kv_bytes_per_token_from_the_config(smollm2):
    from transformers import Qwen3Config

    # SmolLM2-135M: 30 layers, 3 kv heads of 64 -> 2 * 30 * 3 * 64 * 2 bytes in bf16
    assert hg.kv_bytes_per_token(smollm2[0].config, 2) == 23040
    qwen3_8b = Qwen3Config(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                           hidden_size=4096)
    assert hg.kv_bytes_per_token(qwen3_8b, 2) == 2 * 36 * 8 * 128 * 2 == 147456


def test_ladder_width_has_two_steps_per_octave():
    got = [hg.ladder_width(n) for n in (1, 64, 65, 96, 97, 128, 129, 193, 257, 385, 2000, 2049)]
    assert got == [64, 64, 96, 96, 128, 128, 192, 256, 384, 512, 2048, 3072]
    for n in range(1, 5000, 37):
        w = hg.ladder_width(n)
        assert n <= w < max(64, 1.5 * n) + 1


def test_rows_that_fit_follows_the_documented_formula(smollm2):
    config = smollm2[0].config  # SmolLM2: KV 23040 bytes/token in bf16, hidden 576, intermediate 1536
    row = hg.bytes_per_row(config, 2, 256, 320)
    assert row == 23040 * 576 + 256 * (3 * 1536 + 6 * 576) * 2 + 256 * 576 * 2 == 17_694_720
    # 8 GB free: 0.6 * 8e9 / 17_694_720 = 271.3 -> 256 (a multiple of 16)
    assert hg.rows_that_fit(8 * 10**9, row) == 256
    assert hg.rows_that_fit(80 * 10**9, row) == hg.MAX_ROWS_CUDA  # capped
    assert hg.rows_that_fit(80 * 10**9, row, cap=100) == 96
    assert hg.rows_that_fit(10**7, row) == 1  # never zero
    assert hg.rows_that_fit(10**8, row) == 3  # under 16: kept as is
    # Qwen3-8B-shaped, 62 GB free after its weights, 512-token prompts, 1024 new tokens: 127.8 -> 112 rows
    from transformers import Qwen3Config

    qwen = Qwen3Config(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       hidden_size=4096, intermediate_size=12288)
    assert hg.rows_that_fit(62 * 10**9, hg.bytes_per_row(qwen, 2, 512, 1024)) == 112


def test_plan_groups_longest_first_sized_by_width():
    lengths = [10, 300, 40, 200, 12, 90, 300]
    groups = hg.plan_groups(lengths, rows_for=lambda w: 2 if w >= 256 else 3, width_of=hg.ladder_width)
    assert groups == [[1, 6], [3, 5], [2, 4, 0]]  # 200 pads to 256: two rows; 90 to 96: three
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))


def test_plan_groups_splits_widths_when_kv_reads_cost_more_than_a_group():
    """2 long prompts among 100 short ones, SmolLM2 in bf16 (23040 KV bytes per position), 320 new tokens:
    one group reads 102 * 2368 positions per step; two groups read 2 * 2368 + 100 * 384 but pay twice
    the fixed step cost, so they win when a group costs less than ~4.57 GB of KV reads."""
    lengths = [2000, 1900] + [30 + i % 20 for i in range(100)]
    kw = dict(rows_for=lambda w: 1024, width_of=hg.ladder_width, position_cost=23040, max_new_tokens=320)
    short = sorted(range(2, 102), key=lambda i: -lengths[i])
    assert hg.plan_groups(lengths, group_cost=4.5e9, **kw) == [[0, 1], short]
    assert hg.plan_groups(lengths, group_cost=4.7e9, **kw) == [[0, 1] + short]
    # memory still caps a run's groups
    kw["rows_for"] = lambda w: 40
    assert [len(g) for g in hg.plan_groups(lengths, group_cost=4.5e9, **kw)] == [2, 40, 40, 20]


@pytest.fixture(scope="module")
def prompts(smollm2):
    from dflash_train.data.render import ChatRenderer

    renderer = ChatRenderer(smollm2[1], max_length=256)
    questions = ["What is 2+2?", "Name a fruit.", "Say hi.", "Count to three.", "Why is the sky blue? Answer in "
                 "one short sentence that a child would understand, please.", "Give me a word that rhymes with cat."]
    return [renderer.prompt_ids([{"role": "user", "content": q}]) for q in questions]


def _plain(model, tok, prompt):
    """Today's reference: plain greedy generate of one prompt, no padding."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=2)[0, len(prompt):]
    ids = out.tolist()
    ids = ids[: ids.index(2)] if 2 in ids else ids
    return tok.decode(ids, skip_special_tokens=True).strip(), len(ids), len(ids) >= NEW


@pytest.fixture(scope="module")
def reference(smollm2, prompts):
    return [_plain(*smollm2, p) for p in prompts]


def test_cpu_path_equals_plain_generate(smollm2_path, smollm2, prompts, reference, monkeypatch):
    """A CPU's greedy rows: the greedy loop over a static cache, exact widths, finished rows leaving the batch,
    groups sized by CPU_GROUP_BYTES; sampling keeps `generate`, 32 rows a group."""
    gen = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, NEW, 0.0)
    assert gen.static and gen.shrink and gen.width_of(41) == 41 and gen.rows_for(40) == hg.MAX_ROWS_CPU_LOOP
    row = hg.bytes_per_row(gen.model.config, gen.dtype_bytes, 2000, NEW)
    assert gen.rows_for(2000) == hg.CPU_GROUP_BYTES // row < hg.MAX_ROWS_CPU_LOOP  # long prompts: fewer rows
    shrunk = []
    real = static_decode.greedy_decode
    monkeypatch.setattr(static_decode, "greedy_decode", lambda *a, **kw: shrunk.append(kw["shrink"]) or real(*a, **kw))
    gen.max_rows = 4  # two groups: the four longest prompts, then the rest
    seen = []
    for i, r in gen.generate_groups(prompts):
        seen.append(i)
        assert r == reference[i]
    longest = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    assert seen == longest and any(text for text, _, _ in reference) and shrunk == [True, True]
    sampling = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, NEW, 0.7)
    assert not sampling.static and not sampling.shrink and sampling.rows_for(10_000) == hg.MAX_ROWS_CPU


def test_static_cache_path_equals_plain_generate(smollm2_path, smollm2, prompts, reference, monkeypatch):
    """The CUDA path on CPU (eager): static cache reused across groups of one shape, ladder widths,
    a partial group run as it is, and an out-of-memory group split in two."""
    from transformers import StaticCache

    gen = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, NEW, 0.0, static_cache=True)
    assert gen.static and gen.width_of(40) == 64
    gen.max_rows = 4
    calls = []
    real = static_decode.greedy_decode

    def spy(model, step, ids, mask, cache, *a, **kw):
        calls.append((tuple(ids.shape), cache))
        assert isinstance(cache, StaticCache) and kw == {"shrink": False}  # the CUDA path keeps its rows
        return real(model, step, ids, mask, cache, *a, **kw)

    monkeypatch.setattr(static_decode, "greedy_decode", spy)
    assert gen.generate(prompts) == reference
    # 6 prompts of 20-60 tokens: width 64; a full group of 4, then the other 2 (not padded), each its own cache
    assert [shape for shape, _ in calls] == [(4, 64), (2, 64)] and calls[0][1] is not calls[1][1]
    calls.clear()
    assert gen.generate(prompts[:4]) == reference[:4]  # a shape seen before: its kept cache
    assert [shape for shape, _ in calls] == [(4, 64)] and calls[0][1] is gen._caches[(4, 64 + NEW)]

    # out of memory on a group of 4: split in 2 + 2, later groups capped at 2, same answers
    calls.clear()
    failed = []

    def oom_once(model, step, ids, *a, **kw):
        if ids.shape[0] == 4 and not failed:
            failed.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return spy(model, step, ids, *a, **kw)

    monkeypatch.setattr(static_decode, "greedy_decode", oom_once)
    assert gen.generate(prompts) == reference
    assert failed and [shape for shape, _ in calls] == [(2, 64)] * 3 and gen.rows_for(64) == 2

    def always_oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(static_decode, "greedy_decode", always_oom)
    with pytest.raises(DataError, match=r"one prompt of \d+ tokens with --max-new-tokens 6 does not fit.*--engine vllm"):
        gen.generate(prompts[:1])


def test_other_errors_are_not_retried(smollm2_path, smollm2, prompts, monkeypatch):
    gen = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, NEW, 0.0, static_cache=True)

    def broken(*a, **kw):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(static_decode, "greedy_decode", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        gen.generate(prompts)


@pytest.mark.slow
def test_compiled_static_decoding_equals_eager(train_tiny_target, smollm2, prompts):
    """What CUDA runs, compiled on CPU: the greedy loop's decode step over our StaticCache goes through
    torch.compile (as `generate` compiles it, forced on CPU) and gives the same tokens as the eager dynamic path."""
    from transformers import CompileConfig

    eager = hg.HFGenerator(str(train_tiny_target), smollm2[1], STOP, NEW, 0.0, static_cache=False)
    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    compiled = hg.HFGenerator(str(train_tiny_target), smollm2[1], STOP, NEW, 0.0, static_cache=True,
                              compile_config=config)
    compiled.max_rows = eager.max_rows = 4
    # the static path decodes with data/gqa_decode.py's attention (no repeat_kv in the compiled step)
    assert compiled.model.config._attn_implementation == "sdpa_gqa_decode"
    assert eager.model.config._attn_implementation == "sdpa"
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled.generate(prompts) == eager.generate(prompts)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before  # it did compile


def test_an_eager_decode_step_stays_eager_where_it_would_compile(smollm2_path, smollm2, prompts, reference,
                                                                  monkeypatch):
    """`decode_step="eager"` (the bench's `regen-eager`): the greedy loop's step is the model's own call even where
    the config asks for a compile (as CUDA would), and the answers are plain generate's."""
    from transformers import CompileConfig

    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    monkeypatch.setattr(static_decode, "compiled_forward", lambda *a: pytest.fail("the step was compiled"))
    gen = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, NEW, 0.0, static_cache=True, compile_config=config,
                         decode_step="eager")
    assert gen.generate(prompts) == reference
    assert gen._step == gen.model.__call__


def test_partial_groups_run_their_own_rows_and_caches_are_reused_by_shape(smollm2_path, smollm2, prompts,
                                                                        reference, monkeypatch):
    """The regeneration path on CUDA (static cache; here eager on CPU): over two calls with prompts of two
    widths, every group runs exactly its prompts (no padding rows), a group of a shape seen before gets
    the same cache object back (reset, never remade: a CUDA graph recorded over its addresses stays
    valid), and the answers are plain generate's."""
    gen = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, NEW, 0.0, static_cache=True)
    gen.max_rows = 4
    long_prompts = [p + p[-30:] + p[-30:] for p in prompts[:3]]  # 80-120 tokens: width 96 or 128
    long_ref = [_plain(*smollm2, p) for p in long_prompts]
    seen = []
    real = static_decode.greedy_decode

    def spy(model, step, ids, mask, cache, *a, **kw):
        seen.append((tuple(ids.shape), id(cache), len({tuple(r) for r in ids.tolist()})))
        return real(model, step, ids, mask, cache, *a, **kw)

    monkeypatch.setattr(static_decode, "greedy_decode", spy)
    assert gen.generate(prompts + long_prompts) == reference + long_ref
    first = len(seen)
    assert sorted(rows for (rows, _), _, _ in seen) == [2, 3, 4]  # 6 short prompts in 4 + 2, 3 long ones
    assert gen.generate(long_prompts[::-1] + prompts[:2]) == long_ref[::-1] + reference[:2]
    assert len(seen) > first and all(distinct == rows for (rows, _), _, distinct in seen)  # no copies
    caches = {}
    for shape, cache, _ in seen:
        caches.setdefault(shape, set()).add(cache)
    assert any(len([s for s, _, _ in seen if s == shape]) > 1 for shape in caches)  # a shape came again
    assert all(len(ids) == 1 for ids in caches.values()), caches  # and found its cache


def test_rows_are_sized_per_width_and_caches_kept_while_they_fit(smollm2_path, smollm2):
    """On CUDA (free memory known; set by hand here) each width gets the rows its own cache and prefill
    fit, and kept caches are dropped least recently used first once they no longer fit beside a group."""
    gen = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, NEW, 0.0, static_cache=True)
    config, nbytes = gen.model.config, gen.dtype_bytes
    gen.free_bytes = 20 * 10**9
    for w in (64, 256, 2048):
        assert gen.rows_for(w) == hg.rows_that_fit(gen.free_bytes, hg.bytes_per_row(config, nbytes, w, NEW))
    assert gen.rows_for(64) > gen.rows_for(2048) >= 16
    kv, row = hg.kv_bytes_per_token(config, nbytes), hg.bytes_per_row(config, nbytes, 64, NEW)
    cache = kv * (64 + NEW)  # one row's cache at width 64, less than the row's whole share (cache + prefill)...
    assert 2 * cache > row > cache  # ...but two rows' caches are more than it
    # room for a group of 2 beside a kept cache of 4 rows, but not for a group of 1 beside caches of 4 and 2
    gen.free_bytes = int((2 * row + 4 * cache + (2 * cache - row) / 2) / hg.SAFETY)
    a = gen._static_cache(4, 64)
    assert gen._static_cache(4, 64) is a  # the same shape: the kept cache
    b = gen._static_cache(2, 64)
    assert list(gen._caches) == [(4, 64 + NEW), (2, 64 + NEW)]  # both kept
    assert gen._static_cache(4, 64) is a and list(gen._caches) == [(2, 64 + NEW), (4, 64 + NEW)]  # a: most recent
    gen._static_cache(1, 64)  # b, the least recently used, goes
    assert list(gen._caches) == [(4, 64 + NEW), (1, 64 + NEW)] and gen._static_cache(4, 64) is a
    assert gen._static_cache(2, 64) is not b
