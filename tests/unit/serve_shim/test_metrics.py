"""Acceptance numbers from Prometheus text, summed over label sets."""

import pytest

from dflash_train.errors import DFlashError
from serve_shim.metrics import parse_prometheus, render, spec_stats, stats_between

VLLM_TEXT = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="smol"} 40.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="smol"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="smol"} 1.79532962068198e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="smol"} 120.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="smol"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="smol"} 50.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="smol"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="0"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="smol",position="0"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="1"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="smol",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="2"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="smol",position="2"} 1.7e+09
http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 3.0
vllm:num_requests_running{model_name="a \\"quoted\\" name"} 0.0
"""


def test_vllm_numbers_summed_over_labels():
    s = spec_stats(VLLM_TEXT)
    assert (s.engine, s.drafts, s.draft_tokens, s.accepted_tokens) == ("vllm", 50.0, 150.0, 60.0)
    assert s.mean_acceptance_length == pytest.approx(1 + 60 / 50)
    assert s.draft_acceptance_rate == pytest.approx(60 / 150)
    assert s.per_position_acceptance_rate == pytest.approx([35 / 50, 20 / 50, 5 / 50])
    # the per-position rates add up to the accepted tokens per draft
    assert sum(s.per_position_acceptance_rate) == pytest.approx(s.mean_acceptance_length - 1)
    text = render(s, "http://h:1")
    assert "mean acceptance length: 2.2000" in text and "0:0.700" in text


def test_labels_parsed_with_escapes():
    samples = {x.name: x for x in parse_prometheus(VLLM_TEXT)}
    assert samples["vllm:num_requests_running"].labels == {"model_name": 'a "quoted" name'}
    assert samples["http_requests_total"].labels["handler"] == "/v1/completions"


def test_no_drafts_yet():
    s = spec_stats("vllm:spec_decode_num_drafts_total{engine=\"0\"} 0.0\n")
    assert s.engine == "vllm" and s.drafts == 0 and s.mean_acceptance_length is None
    assert "send a request first" in render(s, "u")


def test_sglang_gauges_are_averaged():
    text = ('sglang:spec_accept_length{dp_rank="0",model_name="m",tp_rank="0"} 3.0\n'
            'sglang:spec_accept_length{dp_rank="0",model_name="m",tp_rank="1"} 4.0\n'
            'sglang:spec_accept_rate{model_name="m"} 0.5\n')
    s = spec_stats(text)
    assert (s.engine, s.sglang_accept_length, s.sglang_accept_rate) == ("sglang", 3.5, 0.5)
    assert "accept length (gauge): 3.5000" in render(s, "u")


def test_no_spec_metrics_and_garbage():
    s = spec_stats('http_requests_total{a="b"} 1\n')
    assert s.engine == "none" and "no speculative-decoding metrics" in render(s, "u")
    with pytest.raises(DFlashError, match="line 2"):
        parse_prometheus("ok 1\nnot a sample line at all {\n")


def test_stats_between_snapshots():
    before = spec_stats(VLLM_TEXT)
    later = VLLM_TEXT.replace('engine="1",model_name="smol"} 10.0\nvllm:spec_decode_num_drafts_created',
                              'engine="1",model_name="smol"} 30.0\nvllm:spec_decode_num_drafts_created')
    later = later.replace('accepted_tokens_total{engine="1",model_name="smol"} 10.0',
                          'accepted_tokens_total{engine="1",model_name="smol"} 40.0')
    later = later.replace('position="0"} 5.0', 'position="0"} 25.0').replace('position="1"} 5.0', 'position="1"} 15.0')
    later = later.replace('draft_tokens_total{engine="1",model_name="smol"} 30.0',
                          'draft_tokens_total{engine="1",model_name="smol"} 90.0')
    d = stats_between(before, spec_stats(later))
    assert (d.drafts, d.accepted_tokens, d.draft_tokens) == (20.0, 30.0, 60.0)
    assert d.mean_acceptance_length == pytest.approx(2.5) and d.draft_acceptance_rate == pytest.approx(0.5)
    assert d.per_position_acceptance_rate == pytest.approx([1.0, 0.5, 0.0])
