"""Statistics, JSON report and plot of a speculative-decoding run."""

from __future__ import annotations

import json

import pytest

from dflash_train.eval.report import (
    build_report,
    plot_report,
    step_stats,
    summary_lines,
    write_report_json,
)
from dflash_train.eval.results import Generation, PromptResult, Step


def test_step_stats_counts_positions_and_lengths():
    steps = [Step(4, 3), Step(1, 0), Step(2, 1), Step(3, 2), Step(1, 1)]  # the last one truncated at a limit
    stats = step_stats(steps, block_size=4)
    assert stats["steps"] == 5 and stats["committed_tokens"] == 11
    assert stats["tau"] == pytest.approx(11 / 5)
    assert stats["histogram"] == [2, 1, 1, 1]
    assert stats["per_position"] == pytest.approx([4 / 5, 2 / 5, 1 / 5])


def _results():
    a = PromptResult(0, 10, spec=Generation([5, 6, 7, 8], 1.0, [Step(2, 1), Step(1, 0)]),
                     plain=Generation([5, 6, 7, 8], 3.0), text="abcd")
    b = PromptResult(1, 12, spec=Generation([1, 2, 3], 1.0, [Step(2, 1)]),
                     plain=Generation([1, 2, 4], 1.0), text="xyz")
    return [a, b]


def test_build_report_speedup_and_lossless():
    report = build_report(_results(), 3, greedy=True, measure_speedup=True, settings={"block_size": 3,
                                                                                       "temperature": 0.0})
    assert report["tau"] == pytest.approx(5 / 3)
    assert report["histogram"] == [1, 2, 0]
    assert report["speedup"] == pytest.approx(4.0 / 2.0)
    assert report["lossless"] is False
    assert [p["lossless"] for p in report["prompts"]] == [True, False]
    assert report["prompts"][1]["first_mismatch"] == 2
    assert report["new_tokens"] == 7
    text = "\n".join(summary_lines(report))
    assert "lossless: NO (prompts [1]" in text and "2.00x" in text


def test_sampling_report_has_no_lossless_and_optional_speedup():
    results = _results()
    for r in results:
        r.plain = None
    report = build_report(results, 3, greedy=False, measure_speedup=False, settings={})
    assert report["lossless"] is None and report["speedup"] is None
    assert "lossless" not in report["prompts"][0]


def test_json_and_plot_are_written(tmp_path):
    import matplotlib.image

    report = build_report(_results(), 3, greedy=True, measure_speedup=True,
                          settings={"block_size": 3, "temperature": 0.0})
    out = write_report_json(report, tmp_path / "sub" / "eval.json")
    again = json.loads(out.read_text())
    assert again["histogram"] == [1, 2, 0] and again["lossless"] is False
    assert not list(out.parent.glob(".*tmp*"))
    png = plot_report(report, tmp_path / "eval.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 100 and image.shape[1] > 200
    # with the teacher-forced rates drawn over the served bars: a different picture
    report["teacher_forced"] = {"per_position": {"all": [0.9, 0.8], "at_decode_steps": [0.5, None]}}
    with_tf = matplotlib.image.imread(plot_report(report, tmp_path / "eval-tf.png"))
    assert with_tf.shape == image.shape and (with_tf != image).any()


def test_tau_per_prompt_source():
    results = _results()
    results.append(PromptResult(2, 8, spec=Generation([4, 4, 4, 4, 4], 1.0, [Step(4, 3)]), plain=None, text="",
                                source="code"))
    results[0].source = "chat"
    report = build_report(results, 4, greedy=False, measure_speedup=False, settings={})
    per = report["per_source"]
    assert list(per) == ["chat", "code", "unlabelled"]
    assert per["chat"] == {"tau": 1.5, "per_position": [0.5, 0.0, 0.0], "steps": 2, "prompts": 1}
    assert per["code"]["tau"] == 4.0 and per["unlabelled"]["tau"] == 2.0
    assert [p["source"] for p in report["prompts"]] == ["chat", None, "code"]
    assert "tau by prompt source: chat 1.500 (1 prompt), code 4.000 (1 prompt), unlabelled 2.000 (1 prompt)" in \
        "\n".join(summary_lines(report))
    assert build_report(_results(), 4, greedy=False, measure_speedup=False, settings={})["per_source"] is None
