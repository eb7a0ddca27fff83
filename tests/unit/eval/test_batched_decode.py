"""eval/batched_decode.py: every prompt's blocks verified in one target forward give each prompt exactly the
tokens and steps of decoding it alone, on the real SmolLM2 (left padding, masked rejected slots, rows
leaving the batch at different steps and at EOS) and on tiny targets of other cache kinds; caches that
cannot hold masked holes keep the one-prompt loop."""

from __future__ import annotations

import pytest
import torch
from test_spec_decode_smollm2 import OracleDrafter, _expected_steps

from dflash_train.eval.batched_decode import batchable, batched_speculative_generate
from dflash_train.eval.prompts import render_prompts
from dflash_train.eval.spec_decode import eos_token_ids, plain_generate, speculative_generate
from dflash_train.model.config import DFlashConfig
from dflash_train.model.modeling_dflash import DFlashDraftModel

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = ["Count from one to ten in words.", "Name the planets of the solar system, one per line.",
             "What is 12 + 7?"]


class RowOracle(OracleDrafter):
    """OracleDrafter with one reference per prompt: a row is known by its context cache, met in row order."""

    def forward_block(self, block_embeds, start_positions, cache):
        if id(cache) not in self.row_of:
            self.row_of[id(cache)] = len(self.row_of)
        self.reference, self.wrong_every = self.references[self.row_of[id(cache)]]
        return super().forward_block(block_embeds, start_positions, cache)


def _oracle(target, config, references):
    oracle = RowOracle(config)
    oracle.init_weights(seed=0)
    oracle.attach_target(target)
    oracle.references, oracle.row_of = references, {}
    return oracle


def _steps(gen):
    return [(s.committed, s.accepted, s.position) for s in gen.steps]


def test_rows_of_different_lengths_and_acceptance_decode_as_alone(smollm2):
    target, tokenizer = smollm2
    assert batchable(target)
    prompts = render_prompts(tokenizer, [[{"role": "user", "content": q}] for q in QUESTIONS])
    assert len({len(p) for p in prompts}) == 3  # left padding in the prefill
    eos = eos_token_ids(target, tokenizer)
    plain = [plain_generate(target, p, 20, eos_token_ids=eos) for p in prompts]
    wrong = [5, 3, 7]  # rows accept different numbers of slots: they leave the batch at different steps
    cfg = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=6, mask_token_id=16,
                                  dtype="float32")
    refs = [(p + g.tokens, w) for p, g, w in zip(prompts, plain, wrong, strict=True)]
    alone = []
    for ref, p in zip(refs, prompts, strict=True):
        alone.append(speculative_generate(_oracle(target, cfg, [ref]), target, p, 20, block_size=6,
                                          eos_token_ids=eos))
    finished = []
    many = batched_speculative_generate(_oracle(target, cfg, refs), target, prompts, 20, 6, eos,
                                        on_done=finished.append)
    assert sum(finished) == 3
    for p, g, one, row, w in zip(prompts, plain, alone, many, wrong, strict=True):
        assert row.tokens == g.tokens == one.tokens
        assert _steps(row) == _steps(one)
        assert [s.committed for s in row.steps] == _expected_steps(len(p), len(p) + len(g.tokens), 6, w)
    assert len({len(r.steps) for r in many}) > 1
    assert max(s.committed for r in many for s in r.steps) > 2  # slots accepted mid-block: holes after them


def test_a_row_that_meets_eos_leaves_while_the_others_go_on(smollm2):
    target, tokenizer = smollm2
    prompts = render_prompts(tokenizer, [[{"role": "user", "content": q}] for q in QUESTIONS[:2]])
    plain = [plain_generate(target, p, 16) for p in prompts]
    stop = plain[0].tokens[6]  # an "EOS" the first answer reaches early; the second's answer may too
    cfg = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=16,
                                  dtype="float32")
    refs = [(p + g.tokens, 4) for p, g in zip(prompts, plain, strict=True)]
    alone = [speculative_generate(_oracle(target, cfg, [r]), target, p, 16, block_size=4, eos_token_ids=[stop])
             for r, p in zip(refs, prompts, strict=True)]
    many = batched_speculative_generate(_oracle(target, cfg, refs), target, prompts, 16, 4, [stop])
    assert many[0].tokens[-1] == stop and len(many[0].tokens) <= 7
    for one, row in zip(alone, many, strict=True):
        assert row.tokens == one.tokens and _steps(row) == _steps(one)


def test_the_prefill_pads_nothing_and_the_verify_reads_the_stored_kv_heads(smollm2, monkeypatch):
    """Each prompt is prefilled alone (a padded batch computed all at the longest one's length), and the verify
    forwards' masked blocks attend on the cached K/V heads as stored, without transformers' repeat_kv copies; the
    target's attention setting is given back after."""
    from transformers.integrations import sdpa_attention

    target, tokenizer = smollm2
    prompts = render_prompts(tokenizer, [[{"role": "user", "content": q}] for q in QUESTIONS])
    plain = [plain_generate(target, p, 12) for p in prompts]
    cfg = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=16,
                                  dtype="float32")
    shapes, repeats, real = [], [], sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: repeats.append(a[0].shape) or real(*a))
    hook = target.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                            with_kwargs=True)
    refs = [(p + g.tokens, 3) for p, g in zip(prompts, plain, strict=True)]
    try:
        many = batched_speculative_generate(_oracle(target, cfg, refs), target, prompts, 12, 4)
    finally:
        hook.remove()
    assert [r.tokens for r in many] == [g.tokens for g in plain]
    assert shapes[:3] == [(1, len(p)) for p in prompts]
    assert len(shapes) > 4 and all(s == (len(prompts), 4) for s in shapes[3:5])
    assert repeats == [] and target.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("model_type, can", [("qwen3", True), ("deepseek_v3", True), ("gemma3_text", False),
                                             ("qwen3_next", False)])
def test_other_cache_kinds(model_type, can, tiny_target):
    """Key/value caches (MLA too) batch, with the tokens and steps of decoding alone; sliding-window and
    recurrent caches do not (the one-prompt loop crops and restores them)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(tiny_target(model_type)), dtype=torch.float32).eval()
    assert batchable(target) is can
    if not can:
        return
    cfg = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=16,
                                  num_features=1, dtype="float32")
    draft = DFlashDraftModel(cfg)
    draft.init_weights(seed=0)
    draft.attach_target(target)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (9, 14, 5)]
    alone = [speculative_generate(draft, target, p, 12, block_size=4) for p in prompts]
    many = batched_speculative_generate(draft, target, prompts, 12, 4)
    for one, row in zip(alone, many, strict=True):
        assert row.tokens == one.tokens and _steps(row) == _steps(one)
