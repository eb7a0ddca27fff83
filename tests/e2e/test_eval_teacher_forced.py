"""Issue 13: served acceptance equals teacher-forced acceptance at the decode positions.

The session's accepting drafter (tests/conftest.py: trained through the installed commands on the
real SmolLM2 target) is evaluated by `dflash-train eval` on its run's held-out prompts, greedy and
float32. The eval also puts every decoded sequence through the training forward
(dflash_train/eval/teacher_forced.py), with the features of one full target forward.

Under greedy decoding a block at a decode step's position sees what the served block saw: the same
first token, positions, context (positions before it) and labels (the tokens decoding committed).
So the training forward must reproduce each step's accepted count, not only the average. The two
computations differ only in float32 rounding (a full target forward vs the prefill plus cached
verify forwards; the split training attention vs the inference kernel), which can flip an argmax
only at a near-tie between two draft tokens: on this drafter every step agrees (measured 100%),
and the 1% allowance keeps the test off such a tie on another BLAS.
"""

from __future__ import annotations

import pytest

# the session's drafter (prepare, regenerate, train) is built inside this test's timeout when it runs first
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(3600)]

MIN_TAU = 1.3  # the drafter must accept tokens, or agreement at tau = 1 would prove nothing
MIN_STEP_AGREEMENT = 0.99  # see the module docstring: float32 near-ties only


def test_the_training_forward_reproduces_every_decode_step(accepting_eval):
    report, stdout, timings = accepting_eval
    tf = report["teacher_forced"]
    print(f"\ntau {report['tau']:.4f}; teacher-forced: every position {tf['all']:.4f}, at decode steps "
          f"{tf['at_decode_steps']:.4f}, served {tf['served']:.4f}; step agreement {tf['step_agreement']:.4f} "
          f"of {tf['steps']} steps; bf16 features at decode steps {tf['at_decode_steps_bf16_features']:.4f}\n"
          f"per position, every / at steps / served: {tf['per_position']}\n"
          "timings (s): " + "  ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    assert report["lossless"] is True and report["tau"] >= MIN_TAU
    assert tf["steps"] == report["target_forwards"] and tf["blocks"]["at_decode_steps"] == tf["steps"]
    # `served` is 1 + accepted drafts of the same steps: the eval's own per-position rates add up to it
    assert tf["served"] == pytest.approx(1 + sum(report["per_position"]), abs=1e-9)
    assert tf["per_position"]["served"] == pytest.approx(report["per_position"], abs=1e-9)

    # step by step, and so on average and per slot
    assert tf["step_agreement"] >= MIN_STEP_AGREEMENT, f"steps that differ: {tf['disagreements']}"
    disagreeing = tf["steps"] - round(tf["step_agreement"] * tf["steps"])
    assert len(tf["disagreements"]) == disagreeing
    # each differing step moves the mean by at most (B-1)/steps
    slack = disagreeing * 3 / tf["steps"] + 1e-9
    assert tf["at_decode_steps"] == pytest.approx(tf["served"], abs=slack)
    for a, b in zip(tf["per_position"]["at_decode_steps"], tf["per_position"]["served"], strict=True):
        assert a == pytest.approx(b, abs=disagreeing / tf["steps"] + 1e-9)
    assert tf["verdict"] == "selection"
    assert tf["blocks"]["all"] > tf["steps"]  # every position is more blocks than the steps decoding ran

    # the command prints the diagnosis and its verdict
    assert "teacher-forced block acceptance on these sequences" in stdout and "gap: selection" in stdout
