"""The replay of greedy serving on held-out rows (dflash_train/eval/replay.py): the decode steps that
block lengths imply, the held-out rows' prompt and answer ids, and the sampling errors."""

from __future__ import annotations

import json
import math

import pytest

from dflash_train.errors import ConfigError, DataError
from dflash_train.eval.replay import (
    decode_steps,
    load_heldout_rows,
    paired_difference,
    read_replay,
    run_replay,
    summary_lines,
    tau_with_error,
)


def test_each_step_jumps_by_its_block_length_and_stops_at_the_answer_end():
    # answer of 10 tokens: the prefill gives token 0; steps anchored at 0, 3, 4, 8
    lengths = [3, 1, 1, 1, 4, 2, 2, 2, 5]
    assert decode_steps(lengths, 10) == [3, 1, 4, 1]
    assert sum(decode_steps(lengths, 10)) == 9
    # a block that accepts past the end commits only what is left (the eval's truncation at EOS / the limit)
    assert decode_steps([8] * 9, 10) == [8, 1]
    assert decode_steps([1] * 4, 5) == [1, 1, 1, 1]
    assert decode_steps([], 1) == []  # one token: the prefill's, no step


def test_decode_steps_refuses_missing_or_empty_blocks():
    with pytest.raises(ValueError, match="2 block lengths for an answer of 5 tokens"):
        decode_steps([1, 1], 5)
    with pytest.raises(ValueError, match="block length 0 at token 1"):
        decode_steps([1, 0, 1], 4)


def _rows(pairs, source=None):
    return [{"row": i, "source": source, "tokens": t, "steps": s} for i, (t, s) in enumerate(pairs)]


def test_tau_is_tokens_over_steps_with_a_bootstrap_error_over_rows():
    rows = _rows([(10, 5), (30, 20), (8, 8), (12, 4)])
    out = tau_with_error(rows)
    assert out["tau"] == pytest.approx(60 / 37)
    assert (out["rows"], out["steps"], out["tokens"]) == (4, 37, 60)
    assert 0.05 < out["tau_se"] < 0.6
    assert tau_with_error(rows) == out  # a fixed draw
    # four times the rows, same mix: the error halves (1/sqrt(n)), tau stays
    many = tau_with_error(_rows([(10, 5), (30, 20), (8, 8), (12, 4)] * 4))
    assert many["tau"] == pytest.approx(out["tau"])
    assert many["tau_se"] == pytest.approx(out["tau_se"] / 2, rel=0.25)
    # rows alike: no spread
    assert tau_with_error(_rows([(10, 5)] * 6))["tau_se"] == pytest.approx(0, abs=1e-12)
    assert tau_with_error(_rows([(10, 5)]))["tau_se"] is None


def test_the_paired_difference_cancels_what_the_rows_share():
    hard_and_easy = [(60, 50), (60, 20), (60, 55), (60, 15), (60, 40), (60, 25)]
    a = {"per_row": _rows(hard_and_easy)}
    b = {"per_row": _rows([(t, s + 1) for t, s in hard_and_easy])}  # one step more on every row
    d = paired_difference(a, b)
    assert d["diff"] == pytest.approx(360 / 205 - 360 / 211)
    # the rows' own spread is large, the difference's is small: the paired error is far below either alone
    alone = tau_with_error(a["per_row"])["tau_se"]
    assert 0 < d["se"] < alone / 5
    same = paired_difference(a, a)
    assert same == {"diff": 0.0, "se": 0.0, "rows": 6}
    other = {"per_row": _rows(hard_and_easy[:-1])}
    with pytest.raises(DataError, match="different held-out rows"):
        paired_difference(a, other)


def test_the_paired_difference_per_source_uses_each_sources_rows_alone():
    chat, code = [(60, 30), (40, 20), (50, 40)], [(30, 25), (20, 19)]
    rows_a = _rows(chat, "chat") + [{**r, "row": r["row"] + 3} for r in _rows(code, "code")]
    slower = [{**r, "steps": r["steps"] + (2 if r["source"] == "code" else 0)} for r in rows_a]
    d = paired_difference({"per_row": rows_a}, {"per_row": slower})
    assert set(d["per_source"]) == {"chat", "code"}
    assert d["per_source"]["chat"] == {"diff": 0.0, "se": 0.0, "rows": 3}  # only code's rows changed
    assert d["per_source"]["code"]["diff"] == pytest.approx(50 / 44 - 50 / 48) and d["per_source"]["code"]["rows"] == 2
    assert "per_source" not in paired_difference({"per_row": _rows(chat, "chat")}, {"per_row": _rows(chat, "chat")})


@pytest.fixture
def run_with_holdout(tmp_path, smollm2_path):
    """A prepared mixture (chat answers of several lengths) and a run folder holding out some of its rows."""
    from transformers import AutoTokenizer

    from dflash_train.data.prepare import write_prepared

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    convs, labels = [], []
    for i in range(6):
        convs.append([{"role": "user", "content": f"What is {i} plus {i}?"},
                      {"role": "assistant", "content": f"{i} plus {i} is {2 * i}, an even number." * (1 + i % 3)}])
        labels.append("math")
        convs.append([{"role": "user", "content": f"Greet friend {i}."},
                      {"role": "assistant", "content": f"Hello friend {i}!"}])
        labels.append("chat")
    data = tmp_path / "rows"
    write_prepared(convs, tok, data, {"command": "test"}, max_length=256, labels=labels)
    run = tmp_path / "run"
    run.mkdir()
    (run / "holdout_rows.json").write_text(json.dumps({"data": str(data), "rows": [0, 2, 4, 1, 3]}))
    return run, data, tok


def test_held_out_rows_split_into_the_prompt_and_the_first_answer(run_with_holdout):
    from dflash_train.data.prepare import load_prepared
    from dflash_train.data.render import ChatRenderer

    run, data, tok = run_with_holdout
    rows = load_heldout_rows(run)
    assert [r.row for r in rows] == [1, 0, 3, 2, 4]  # sorted ids, the sources taking turns (chat first)
    assert [r.source for r in rows] == ["chat", "math", "chat", "math", "math"]
    ds = load_prepared(data)
    renderer = ChatRenderer(tok)
    for r in rows:
        messages = json.loads(ds[r.row]["messages"])
        # the prompt is what the eval renders (user turn + generation prompt); the answer ends with the turn's end
        assert r.prompt_ids == renderer.prompt_ids(messages[:1])
        assert tok.decode(r.answer_ids).startswith(messages[1]["content"])
        assert r.prompt_ids + r.answer_ids == ds[r.row]["input_ids"][:len(r.prompt_ids) + len(r.answer_ids)]
    assert rows[1].answer_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    cut = load_heldout_rows(run / "holdout_rows.json", max_rows=3, max_new_tokens=4)
    assert [r.row for r in cut] == [1, 0, 3] and all(len(r.answer_ids) == 4 for r in cut)
    assert [r.prompt_ids for r in cut] == [r.prompt_ids for r in rows[:3]]


def test_bad_rows_and_reports_are_refused_by_name(tmp_path, run_with_holdout):
    with pytest.raises(DataError, match=r"--rows .*nothing: not a training run's holdout_rows.json"):
        load_heldout_rows(tmp_path / "nothing")
    run, data, _ = run_with_holdout
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "holdout_rows.json").write_text(json.dumps({"data": str(data), "rows": []}))
    with pytest.raises(DataError, match="held out no rows; train with data.holdout_fraction > 0"):
        load_heldout_rows(empty)
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps({"tau": 1.5}))
    with pytest.raises(DataError, match=r"--baseline .*report.json: not a `dflash-train replay --json` report"):
        read_replay(bad)
    with pytest.raises(ConfigError, match="--dtype int8: choose one of bfloat16, float16, float32"):
        run_replay(str(run), str(run), dtype="int8", progress=False)


def test_the_summary_names_tau_its_error_and_the_paired_difference():
    rows = _rows([(10, 5), (30, 20)], "chat")
    report = {**tau_with_error(rows), "per_row": rows, "block_size": 8, "every_position": 1.9,
              "per_source": {"chat": tau_with_error(rows)},
              "versus": {"baseline": "base.json", "baseline_tau": 1.5, "diff": 0.0123, "se": 0.004}}
    text = "\n".join(summary_lines(report))
    assert f"tau {40 / 25:.3f} ± {report['tau_se']:.3f}" in text and "; chat 1.600" in text
    assert "against base.json (tau 1.500): +0.012 ± 0.004 (paired" in text
    assert math.isclose(report["tau"], 1.6)


def test_the_summary_splits_acceptance_at_repeated_text_from_the_rest():
    rows = _rows([(10, 5)], "chat")
    split = {"repeat": {"share": 0.25, "accept_len": 3.5, "copy_accept_len": 3.75},
             "other": {"share": 0.75, "accept_len": 1.25}}
    report = {**tau_with_error(rows), "per_row": rows, "block_size": 4, "every_position": 1.8125,
              "every_position_by_repeat": split, "per_source": {"chat": tau_with_error(rows)}}
    text = "\n".join(summary_lines(report))
    assert "25% of positions): 3.500 (copying that text: 3.750); elsewhere 1.250" in text
