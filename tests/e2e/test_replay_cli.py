"""`dflash-train replay` reproduces the served decode steps of `dflash-train eval`, prompt by prompt.

The session's accepting drafter (tests/conftest.py: prepare, regenerate and train through the installed
commands on the real SmolLM2 target) is decoded by `dflash-train eval` on its run's held-out prompts,
greedy and float32. Its rows' answers are the target's own greedy answers (HF generate, float32, the
same token limit), so where a row's answer is the eval's output, replaying the row must give the same
number of decode steps: the steps follow from the block lengths at every position (replay.py). A row
can differ from the eval's output only where the regeneration's batched forward and the eval's single
one round a near-tie differently; the test needs most rows alike and every alike row exact.
"""

from __future__ import annotations

import json

import pytest
from conftest import ACCEPTING_MAX_NEW_TOKENS, ACCEPTING_PROMPTS, run_dflash_train

from dflash_train.data.repeats import repeat_anchors
from dflash_train.eval.replay import load_heldout_rows

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(3600)]


def test_replay_gives_every_prompt_the_steps_that_serving_took(accepting_run, accepting_eval, tmp_path):
    run, _ = accepting_run
    report, _, _ = accepting_eval
    out = tmp_path / "replay.json"
    stdout, _ = run_dflash_train("replay", "--draft", str(run / "final"), "--rows", str(run), "--max-rows",
                                 str(ACCEPTING_PROMPTS), "--max-new-tokens", str(ACCEPTING_MAX_NEW_TOKENS),
                                 "--json", str(out))
    replayed = json.loads(out.read_text())
    rows = load_heldout_rows(run, ACCEPTING_PROMPTS, ACCEPTING_MAX_NEW_TOKENS)
    assert len(replayed["per_row"]) == len(report["prompts"]) == len(rows) == ACCEPTING_PROMPTS
    alike = 0
    for held, row, served in zip(rows, replayed["per_row"], report["prompts"], strict=True):
        assert row["row"] == held.row and row["tokens"] == len(held.answer_ids) - 1
        if held.answer_ids != served["output_tokens"]:
            continue  # the row's answer is not the eval's output: another text, other steps
        alike += 1
        assert row["steps"] == served["target_forwards"], (row, served["histogram"])
        assert sum(row["committed"]) == row["tokens"]
    assert alike >= ACCEPTING_PROMPTS - 2
    assert report["tau"] > 1.3  # a drafter that accepts: equal steps at tau 1 would prove nothing
    if alike == ACCEPTING_PROMPTS:
        assert replayed["tau"] == pytest.approx(report["tau"], abs=1e-9)
    assert f"tau {replayed['tau']:.3f} ± {replayed['tau_se']:.3f}" in stdout
    # every answer position is either a copy of earlier text or not; the two means recompose the whole one
    split = replayed["every_position_by_repeat"]
    flags = [repeat_anchors([*h.prompt_ids, *h.answer_ids],
                            list(range(len(h.prompt_ids), len(h.prompt_ids) + len(h.answer_ids) - 1)),
                            replayed["block_size"])[0] for h in rows]
    flat = [bool(f) for part in flags for f in part.tolist()]
    assert split["repeat"]["share"] == pytest.approx(sum(flat) / len(flat))
    assert split["repeat"]["share"] + split["other"]["share"] == pytest.approx(1.0)
    if any(flat):
        assert 1.0 <= split["repeat"]["copy_accept_len"] <= replayed["block_size"]
    assert sum(split[k]["share"] * split[k]["accept_len"] for k in ("repeat", "other")
               if split[k]["accept_len"] is not None) == pytest.approx(replayed["every_position"])

    # a second drafter against the first: the paired difference, and zero against itself
    again = tmp_path / "again.json"
    stdout, _ = run_dflash_train("replay", "--draft", str(run / "final"), "--rows", str(run), "--max-rows",
                                 str(ACCEPTING_PROMPTS), "--max-new-tokens", str(ACCEPTING_MAX_NEW_TOKENS),
                                 "--baseline", str(out), "--json", str(again))
    versus = json.loads(again.read_text())["versus"]
    assert versus["diff"] == 0 and versus["se"] == 0 and versus["rows"] == ACCEPTING_PROMPTS
    assert f"against {out} (tau {replayed['tau']:.3f}): +0.000 ± 0.000" in stdout

    # the same drafter verified by a bf16 target (what a bf16 server does), paired against float32: the same rows,
    # a tau within bf16's near-tie flips of float32's (a drafter broken in bf16 would fall to ~1, below 1.3 - 0.2)
    bf16 = tmp_path / "bf16.json"
    run_dflash_train("replay", "--draft", str(run / "final"), "--rows", str(run), "--max-rows", str(ACCEPTING_PROMPTS),
                     "--max-new-tokens", str(ACCEPTING_MAX_NEW_TOKENS), "--dtype", "bfloat16", "--baseline", str(out),
                     "--json", str(bf16))
    in_bf16 = json.loads(bf16.read_text())
    assert in_bf16["settings"]["dtype"] == "bfloat16" and replayed["settings"]["dtype"] == "float32"
    assert in_bf16["versus"]["rows"] == ACCEPTING_PROMPTS
    assert abs(in_bf16["versus"]["diff"]) < 0.2, in_bf16["versus"]
