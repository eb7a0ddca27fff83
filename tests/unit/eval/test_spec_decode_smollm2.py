"""`evaluate` on the real SmolLM2 target with a randomly initialised drafter."""

from __future__ import annotations

import warnings

import pytest
import torch

from dflash_train.eval.spec_decode import evaluate
from dflash_train.model.config import DFlashConfig
from dflash_train.model.modeling_dflash import DFlashDraftModel

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    [{"role": "user", "content": "What is 12 + 7?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."},
     {"role": "assistant", "content": "Red, green, blue."}, {"role": "user", "content": "More?"}],
]


@pytest.fixture(scope="module")
def random_drafter(smollm2):
    target, tokenizer = smollm2
    cfg = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=6, mask_token_id=16,
                                  dtype="float32")
    draft = DFlashDraftModel(cfg)
    draft.init_weights(seed=0)
    return draft  # not attached: evaluate must attach it


def _check_consistent(report, block_size, n_prompts):
    assert len(report["histogram"]) == block_size
    assert len(report["per_position"]) == block_size - 1
    assert sum(report["histogram"]) == report["target_forwards"]
    lengths = report["histogram_lengths"]
    assert sum(n * c for n, c in zip(lengths, report["histogram"], strict=True)) == report["committed_tokens"]
    # every prompt's first token comes from the prefill, outside tau
    assert report["new_tokens"] == report["committed_tokens"] + n_prompts
    assert report["tau"] == pytest.approx(report["committed_tokens"] / report["target_forwards"])
    rates = report["per_position"]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))  # slot k accepted implies slot k-1 accepted


def test_greedy_is_lossless_with_a_random_drafter(smollm2, random_drafter):
    target, tokenizer = smollm2
    random_drafter.train()  # as the trainer hands it over
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = evaluate(random_drafter, target, tokenizer, PROMPTS, max_new_tokens=12, block_size=4)
    # the cache goes in under the name this transformers takes (`cache` since 5.24; 5.40 drops the old one)
    assert not [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert random_drafter.training  # given back in the mode it came in
    assert report["lossless"] is True
    assert all(p["lossless"] and p["first_mismatch"] is None for p in report["prompts"])
    assert report["tau"] >= 1.0
    assert report["speedup"] is not None and report["speedup"] > 0
    assert report["settings"]["block_size"] == 4 and report["settings"]["drafter_block_size"] == 6
    _check_consistent(report, 4, len(PROMPTS))
    # the plain run is the reference: same tokens, and a non-trivial answer
    for p in report["prompts"]:
        assert p["new_tokens"] == p["plain_new_tokens"]
        assert p["output_text"].strip()
    # the training forward on the decoded sequences reproduces every step (a random drafter accepts nothing)
    tf = report["teacher_forced"]
    assert tf["steps"] == report["target_forwards"] and tf["step_agreement"] == 1.0
    assert tf["served"] == pytest.approx(1 + sum(report["per_position"]))
    assert tf["blocks"]["all"] == report["new_tokens"] - len(PROMPTS)  # every generated token with a successor


def test_without_the_speedup_run_losslessness_comes_from_the_teacher_forced_argmax(smollm2, random_drafter):
    """--no-speedup: no plain decoding; each generated token is checked against the target's argmax after
    its prefix in the teacher-forced forward, which flags a token the decoding got wrong at its index."""
    from dflash_train.eval.results import Generation
    from dflash_train.eval.teacher_forced import teacher_forced_report

    target, tokenizer = smollm2
    with_plain = evaluate(random_drafter, target, tokenizer, PROMPTS, max_new_tokens=12, block_size=4)
    report = evaluate(random_drafter, target, tokenizer, PROMPTS, max_new_tokens=12, block_size=4,
                      measure_speedup=False)
    assert report["speedup"] is None and all("plain_seconds" not in p for p in report["prompts"])
    assert report["settings"]["lossless_check"] == "teacher-forced argmax"
    assert with_plain["settings"]["lossless_check"] == "plain decode"
    # nothing to time: every prompt decoded at once (batched_decode.py), the tokens of decoding each alone
    assert report["settings"]["batched"] is True and with_plain["settings"]["batched"] is False
    assert report["lossless"] is True and all(p["first_mismatch"] is None for p in report["prompts"])
    assert [p["output_tokens"] for p in report["prompts"]] == [p["output_tokens"] for p in with_plain["prompts"]]
    # a decoding that committed a wrong token at index 5 is caught there
    from dflash_train.eval.prompts import render_prompts

    ids = render_prompts(tokenizer, PROMPTS[:1])
    tokens = list(report["prompts"][0]["output_tokens"])
    tokens[5] = (tokens[5] + 1) % tokenizer.vocab_size
    tf = teacher_forced_report(random_drafter, target, ids, [Generation(tokens=tokens, seconds=0.0, steps=[])], 4)
    assert tf["greedy_mismatch"] == [5]


def test_sampling_runs_and_reports_no_lossless_check(smollm2, random_drafter):
    target, tokenizer = smollm2
    report = evaluate(random_drafter, target, tokenizer, PROMPTS[:1], max_new_tokens=8, temperature=0.8,
                      seed=3, measure_speedup=False)
    assert report["lossless"] is None and report["speedup"] is None
    assert "teacher_forced" not in report  # sampled steps have no block-by-block teacher-forced counterpart
    assert report["tau"] >= 1.0
    _check_consistent(report, 6, 1)
    again = evaluate(random_drafter, target, tokenizer, PROMPTS[:1], max_new_tokens=8, temperature=0.8,
                     seed=3, measure_speedup=False)
    assert again["prompts"][0]["output_tokens"] == report["prompts"][0]["output_tokens"]  # seeded


class OracleDrafter(DFlashDraftModel):
    """Proposes a known continuation, wrong on purpose at every position divisible by `wrong_every`.

    Acceptance is then known in advance, and a bug in the target's cache handling (crop, positions)
    shows up as a divergence from plain decoding, which the Markov tiny targets cannot reveal.
    """

    reference: list[int]
    wrong_every: int

    def forward_block(self, block_embeds, start_positions, cache):
        self._start = int(start_positions[0])
        return super().forward_block(block_embeds, start_positions, cache)

    def logits(self, hidden):
        n = hidden.shape[-2]
        out = torch.full((n, self.config.vocab_size), -1e4)
        for k in range(1, n + 1):
            pos = self._start + k
            tok = self.reference[pos] if pos < len(self.reference) else 0
            out[k - 1, (tok + 1) % self.config.vocab_size if pos % self.wrong_every == 0 else tok] = 0.0
        return out


def _expected_steps(start: int, end: int, block_size: int, wrong_every: int) -> list[int]:
    """Committed lengths when slot k (at position p + k) is right unless (p + k) % wrong_every == 0."""
    steps, p = [], start
    while p < end - 1:
        a = 0
        while a < block_size - 1 and (p + a + 1) % wrong_every != 0:
            a += 1
        n = min(a + 1, end - 1 - p)
        steps.append(n)
        p += n
    return steps


def test_partial_acceptance_on_the_real_target_is_lossless_and_exact(smollm2, random_drafter):
    from dflash_train.eval.prompts import render_prompts
    from dflash_train.eval.spec_decode import eos_token_ids, plain_generate, speculative_generate

    target, tokenizer = smollm2
    (ids,) = render_prompts(tokenizer, [[{"role": "user", "content": "Count from one to ten in words."}]])
    plain = plain_generate(target, ids, 24, eos_token_ids=eos_token_ids(target, tokenizer))
    oracle = OracleDrafter(random_drafter.config)
    oracle.load_state_dict(random_drafter.state_dict())
    oracle.attach_target(target)
    oracle.reference, oracle.wrong_every = ids + plain.tokens, 5
    spec = speculative_generate(oracle, target, ids, 24, block_size=6,
                                eos_token_ids=eos_token_ids(target, tokenizer))
    assert spec.tokens == plain.tokens
    # the prefill token sits at position len(ids); each step starts at the last committed position
    expected = _expected_steps(len(ids), len(ids) + len(plain.tokens), 6, 5)
    assert [s.committed for s in spec.steps] == expected
    assert max(expected) > 2  # several drafts accepted in a row: the cache is cropped mid-block
