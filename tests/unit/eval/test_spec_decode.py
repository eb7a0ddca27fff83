"""The speculative loop on hand-built targets/drafters whose acceptance is known in advance."""

from __future__ import annotations

import pytest
from handbuilt_models import MASK, constant_drafter, copy_drafter, cycle_target

from dflash_train.errors import ConfigError
from dflash_train.eval.report import step_stats
from dflash_train.eval.spec_decode import plain_generate, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")

# 1 -> 2 -> 3 -> 4 -> 1 (period 4); 0, 5, 6 and MASK map to themselves
CYCLE = [0, 2, 3, 4, 1, 5, 6, MASK]
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def target():
    return cycle_target(CYCLE)


def _run(draft, target, max_new, block_size=None, eos=()):
    draft.attach_target(target)
    spec = speculative_generate(draft, target, PROMPT, max_new, block_size=block_size, eos_token_ids=eos)
    plain = plain_generate(target, PROMPT, max_new, eos_token_ids=eos)
    assert spec.tokens == plain.tokens  # lossless
    return spec, step_stats(spec.steps, block_size or draft.config.block_size)


def test_plain_decoding_follows_the_cycle(target):
    assert plain_generate(target, PROMPT, 6).tokens == [1, 2, 3, 4, 1, 2]


def test_drafter_that_is_never_right_gives_tau_1(target):
    # every slot proposes MASK, which the target never emits
    spec, stats = _run(constant_drafter(block_size=4), target, max_new=13)
    assert len(spec.tokens) == 13
    assert stats["tau"] == 1.0
    assert stats["steps"] == 12
    assert stats["histogram"] == [12, 0, 0, 0]
    assert stats["per_position"] == [0.0, 0.0, 0.0]


def test_constant_drafter_inside_the_cycle_has_known_counts():
    # MASK -> 3 in the head: every slot proposes 3. From x=2 slot 1 is right (3) and slot 2 wrong (4):
    # commit 2; from x=1 or x=4 nothing is accepted: commit 1. Per 4 tokens: steps of 1, 2, 1.
    table = list(CYCLE)
    table[MASK] = 3
    target = cycle_target(table)
    spec, stats = _run(constant_drafter(block_size=4), target, max_new=13)
    assert [s.committed for s in spec.steps] == [1, 2, 1] * 3
    assert stats["histogram"] == [6, 3, 0, 0]
    assert stats["tau"] == pytest.approx(12 / 9)
    assert stats["per_position"] == pytest.approx([3 / 9, 0.0, 0.0])


@pytest.mark.parametrize("reduced", [False, True])
@pytest.mark.parametrize("block_size", [4, 8])
def test_exact_drafter_gives_tau_b(target, reduced, block_size):
    draft = copy_drafter(block_size, period=4, next_table=CYCLE, reduced=reduced)
    assert draft.config.reduced_vocab is reduced
    steps = 3
    spec, stats = _run(draft, target, max_new=1 + steps * block_size)
    assert stats["tau"] == block_size
    assert stats["histogram"] == [0] * (block_size - 1) + [steps]
    assert stats["per_position"] == [1.0] * (block_size - 1)


def test_smaller_block_size_uses_fewer_slots(target):
    draft = copy_drafter(8, period=4, next_table=CYCLE)
    spec, stats = _run(draft, target, max_new=1 + 5 * 3, block_size=3)
    assert stats["tau"] == 3.0
    assert stats["histogram"] == [0, 0, 5]
    assert stats["per_position"] == [1.0, 1.0]


def test_block_crossing_max_new_tokens_is_truncated(target):
    # prefill gives 1 token, step 1 commits 4 (total 5), step 2 may keep only 1 of its 4
    spec, stats = _run(copy_drafter(4, period=4, next_table=CYCLE), target, max_new=6)
    assert spec.tokens == [1, 2, 3, 4, 1, 2]
    assert [(s.committed, s.accepted) for s in spec.steps] == [(4, 3), (1, 1)]
    assert stats["tau"] == 2.5
    assert stats["histogram"] == [1, 0, 0, 1]


def test_block_crossing_eos_is_truncated(target):
    # EOS = 3: the block [1 | 2 3 4] + bonus 1 is all accepted, but only "2 3" is kept
    spec, stats = _run(copy_drafter(4, period=4, next_table=CYCLE), target, max_new=50, eos=[3])
    assert spec.tokens == [1, 2, 3]
    assert [(s.committed, s.accepted) for s in spec.steps] == [(2, 2)]
    assert stats["histogram"] == [0, 1, 0, 0]


def test_eos_from_prefill_needs_no_step(target):
    spec, stats = _run(constant_drafter(4), target, max_new=10, eos=[1])
    assert spec.tokens == [1]
    assert spec.steps == [] and stats["tau"] is None


def test_block_size_larger_than_trained_is_refused(target):
    draft = constant_drafter(block_size=4).attach_target(target)
    with pytest.raises(ConfigError, match="--block-size 5"):
        speculative_generate(draft, target, PROMPT, 4, block_size=5)
    with pytest.raises(ConfigError, match="--max-new-tokens"):
        speculative_generate(draft, target, PROMPT, 0)
