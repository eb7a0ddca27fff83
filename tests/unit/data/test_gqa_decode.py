"""The target's attention for regeneration and the eval's verify: one-token queries and blocks of a few attend on
the stored K/V heads (no repeat_kv), and give what transformers' SDPA gives, eager and compiled, on random tensors
and on the real SmolLM2 target."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.integrations import sdpa_attention

from dflash_train.data.gqa_decode import NAME, gqa_decode_attention, use_gqa_decode


class _Layer(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _inputs(batch=3, kv_heads=2, groups=3, q_len=1, kv_len=11, dim=16, mask="bool"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, kv_heads * groups, q_len, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, kv_len, dim, generator=g) for _ in range(2))
    keep = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool)
    keep[1, ..., :4] = False  # left padding of different lengths
    keep[2, ..., :7] = False
    if mask == "bool":
        m = keep
    elif mask == "float":
        m = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    else:
        m = None
    return q, k, v, m


def _equals_sdpa_without_repeating_kv(monkeypatch, q, k, v, m, shape):
    layer = _Layer(groups=3)
    want, _ = sdpa_attention.sdpa_attention_forward(layer, q, k, v, m, scaling=0.25)
    calls = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: calls.append(a) or real(*a))
    got, _ = gqa_decode_attention(layer, q, k, v, m, scaling=0.25)
    assert got.shape == want.shape == shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert calls == []  # the stored heads were read as they are


@pytest.mark.parametrize("mask", ["bool", "float", "none"])
def test_decode_step_equals_transformers_sdpa_without_repeating_kv(mask, monkeypatch):
    _equals_sdpa_without_repeating_kv(monkeypatch, *_inputs(mask=mask), shape=(3, 1, 6, 16))


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_a_verified_block_equals_transformers_sdpa_without_repeating_kv(mask, monkeypatch):
    """A block of query tokens over a longer cache (the eval's batched verify): causal inside the block, holes
    of rejected slots before it; the folded heads give transformers' result without repeat_kv."""
    q, k, v, keep = _inputs(q_len=4, kv_len=13)
    keep = keep & torch.ones(4, 13, dtype=torch.bool).tril(9)  # query i sees keys up to 9 + i
    keep[0, ..., 5] = False  # a rejected slot of an earlier block
    m = keep if mask == "bool" else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    _equals_sdpa_without_repeating_kv(monkeypatch, q, k, v, m, shape=(3, 4, 6, 16))


def test_compiled_decode_step_equals_eager():
    """Under torch.compile, where transformers' own SDPA path would call repeat_kv, the folded query
    still gives the eager result."""
    q, k, v, m = _inputs(mask="bool", kv_len=37)
    layer = _Layer(groups=3)
    want, _ = sdpa_attention.sdpa_attention_forward(layer, q, k, v, m)
    compiled = torch.compile(lambda *a: gqa_decode_attention(layer, *a)[0], fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, m), want, rtol=1e-5, atol=1e-6)


def test_prefill_and_plain_heads_go_to_transformers_sdpa(monkeypatch):
    seen = []
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda *a, **kw: seen.append(a[1].shape) or (a[1], None))
    gqa_decode_attention(_Layer(groups=3), *_inputs(q_len=5, kv_len=5))  # prefill
    gqa_decode_attention(_Layer(groups=3), *_inputs(q_len=17, kv_len=40))  # a chunk longer than a block
    gqa_decode_attention(_Layer(groups=3), *_inputs(q_len=4, kv_len=40, mask="none"))  # no mask: causal from key 0
    gqa_decode_attention(_Layer(groups=1), *_inputs(groups=1))  # no GQA
    assert seen == [(3, 6, 5, 16), (3, 6, 17, 16), (3, 6, 4, 16), (3, 2, 1, 16)]


def test_smollm2_generates_the_same_tokens_with_it(smollm2):
    """The real target (9 query heads on 3 K/V heads), left-padded batch, greedy: same tokens and logits."""
    model, tok = smollm2
    assert model.config.num_attention_heads // model.config.num_key_value_heads == 3
    gqa = copy.deepcopy(model)
    use_gqa_decode(gqa)
    assert gqa.config._attn_implementation == NAME and model.config._attn_implementation == "sdpa"
    tok.padding_side = "left"
    batch = tok(["The capital of France is", "Write a haiku about the sea, please:"], return_tensors="pt",
                padding=True)
    args = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id or 2)
    want, got = model.generate(**batch, **args), gqa.generate(**batch, **args)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
