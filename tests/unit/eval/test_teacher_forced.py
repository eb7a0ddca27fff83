"""The training forward on decoded sequences, on hand-built targets/drafters whose acceptance is known."""

from __future__ import annotations

import pytest
from handbuilt_models import MASK, constant_drafter, copy_drafter, cycle_target

from dflash_train.eval.report import teacher_forced_lines
from dflash_train.eval.results import Generation, Step
from dflash_train.eval.spec_decode import speculative_generate
from dflash_train.eval.teacher_forced import teacher_forced_report

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [1, 2, 3, 4, 1, 2, 3, 4]
CYCLE = [0, 2, 3, 4, 1, 5, 6, MASK]  # 1 -> 2 -> 3 -> 4 -> 1


def _decode(draft, target, max_new):
    draft.attach_target(target)
    return speculative_generate(draft, target, PROMPT, max_new)


def test_decode_steps_skip_an_easy_position_so_both_averages_are_known():
    # MASK -> 3: every slot proposes 3. A block at token 2 accepts slot 1 (3) and commits "3 4", so
    # serving never starts a step at token 3; the training forward sees every position.
    table = list(CYCLE)
    table[MASK] = 3
    target = cycle_target(table)
    gen = _decode(constant_drafter(block_size=4), target, max_new=13)
    assert [s.position for s in gen.steps] == [8, 9, 11, 12, 13, 15, 16, 17, 19]
    tf = teacher_forced_report(constant_drafter(block_size=4).attach_target(target), target, [PROMPT], [gen], 4)
    # every generated position with a successor: tokens 1 2 3 4 x3 -> lengths 1 2 1 1
    assert tf["blocks"]["all"] == 12 and tf["all"] == pytest.approx(15 / 12)
    # the nine steps start at tokens 1 2 4 -> lengths 1 2 1, exactly what serving committed
    assert tf["at_decode_steps"] == pytest.approx(12 / 9) and tf["served"] == pytest.approx(12 / 9)
    assert tf["per_position"]["all"] == pytest.approx([3 / 12, 0.0, 0.0])
    assert tf["per_position"]["at_decode_steps"] == tf["per_position"]["served"] == pytest.approx([3 / 9, 0, 0])
    assert tf["step_agreement"] == 1.0 and tf["steps"] == 9 and tf["disagreements"] == []
    assert tf["at_decode_steps_bf16_features"] == pytest.approx(12 / 9)  # one-hot features round exactly
    assert tf["verdict"] == "selection"
    text = "\n".join(teacher_forced_lines(tf))
    assert "every position 1.250, at decode steps 1.333, served 1.333" in text
    assert "100.0% of 9 steps agree" in text and "gap: selection" in text


@pytest.mark.parametrize("reduced", [False, True])
def test_exact_drafter_agrees_step_by_step_up_to_a_truncated_block(reduced):
    target = cycle_target(CYCLE)
    draft = copy_drafter(4, period=4, next_table=CYCLE, reduced=reduced)
    gen = _decode(draft, target, max_new=6)  # steps (4, 3) and (1, 1): the second is cut at the limit
    assert [(s.committed, s.accepted, s.position) for s in gen.steps] == [(4, 3, 8), (1, 1, 12)]
    tf = teacher_forced_report(draft, target, [PROMPT], [gen], 4)
    # the last block has one labelled slot (the token at 13): length 2, as 1 + accepted
    assert tf["at_decode_steps"] == tf["served"] == pytest.approx(3.0)
    assert tf["step_agreement"] == 1.0
    # every position 8..12: full blocks while labels last (4 4 4 3 2)
    assert tf["all"] == pytest.approx((4 + 4 + 4 + 3 + 2) / 5)


def test_a_served_record_the_training_forward_does_not_reproduce_is_a_mismatch():
    target = cycle_target(CYCLE)
    draft = copy_drafter(4, period=4, next_table=CYCLE)
    gen = _decode(draft, target, max_new=13)
    # pretend serving accepted one draft fewer at the second step than the training forward does
    steps = [Step(s.committed, s.accepted - (i == 1), s.position) for i, s in enumerate(gen.steps)]
    tf = teacher_forced_report(draft, target, [PROMPT, PROMPT], [gen, Generation(gen.tokens, 0.0, steps)], 4)
    assert tf["steps"] == 6 and tf["step_agreement"] == pytest.approx(5 / 6)
    assert tf["disagreements"] == [{"prompt": 1, "position": 12, "served_accepted": 2, "teacher_forced_accepted": 3}]
    assert tf["verdict"] == "mismatch"
    text = "\n".join(teacher_forced_lines(tf))
    assert "gap: MISMATCH" in text and "at 1 of 6 steps" in text and "prompt 1 position 12" in text
