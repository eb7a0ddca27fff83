"""Assistant loss masks on real tokenizers with ChatML, Llama 3 and Qwen3 templates (built offline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_train.data.render import DROP_NO_ASSISTANT, DROP_NO_SUPERVISED, ChatRenderer
from dflash_train.errors import DataError

TEMPLATES = Path(__file__).resolve().parents[2] / "assets" / "chat_templates"
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]
THINK_CONV = [{"role": "user", "content": "hi"},
              {"role": "assistant", "content": "<think>\ngreet\n</think>\n\nhello there"},
              {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}]


def tokenizer(smollm2_path, template: str | None = None, specials=()):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    if template:
        tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tok


def supervised(tok, row) -> str:
    return tok.decode([t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m])


def spans(tok, row) -> list[str]:
    """Decoded runs of consecutive supervised tokens."""
    out, cur = [], []
    for t, m in zip(row.input_ids, row.loss_mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def test_smollm2_chatml_multi_turn_with_system(smollm2_path):
    tok = tokenizer(smollm2_path)
    row = ChatRenderer(tok, max_length=512).render(CONV)
    assert spans(tok, row) == ["hello there<|im_end|>", "4<|im_end|>"]
    assert row.input_ids == tok.apply_chat_template(CONV, tokenize=True, return_dict=True)["input_ids"]
    assert not row.truncated


def test_chatml_default_system_prompt(smollm2_path):
    tok = tokenizer(smollm2_path, "chatml_qwen2")
    row = ChatRenderer(tok, max_length=512).render(CONV[1:])
    assert "You are Qwen" in tok.decode(row.input_ids)
    assert spans(tok, row) == ["hello there<|im_end|>", "4<|im_end|>"]


def test_generation_markers_agree_with_rendered_prefixes(smollm2_path):
    tok = tokenizer(smollm2_path, "chatml_generation")
    marked = ChatRenderer(tok, max_length=512)
    assert marked.markers
    prefixes = ChatRenderer(tok, max_length=512)
    prefixes.markers = False
    prefixes._eot, prefixes._eot_last = prefixes._end_of_turn_marker(last=False), prefixes._end_of_turn_marker(last=True)
    for conv in (CONV, CONV[1:], THINK_CONV):
        a, b = marked.render(conv), prefixes.render(conv)
        assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask
    assert spans(tok, marked.render(CONV)) == ["hello there<|im_end|>", "4<|im_end|>"]


def test_llama3(smollm2_path):
    tok = tokenizer(smollm2_path, "llama3", LLAMA3_SPECIALS)
    tok.bos_token = "<|begin_of_text|>"
    r = ChatRenderer(tok, max_length=512)
    assert r._eot == "<|eot_id|>"
    row = r.render(CONV)
    assert row.input_ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert spans(tok, row) == ["hello there<|eot_id|>", "4<|eot_id|>"]
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert row.input_ids[-1] == eot and row.loss_mask[-1] == 1
    # the header before an answer is never supervised
    header = tok.convert_tokens_to_ids("<|end_header_id|>")
    assert all(m == 0 for t, m in zip(row.input_ids, row.loss_mask, strict=True) if t == header)


def test_qwen3_thinking_on_and_off(smollm2_path):
    tok = tokenizer(smollm2_path, "qwen3", ["<think>", "</think>"])
    on = ChatRenderer(tok, max_length=512, thinking=True)
    # history turns lose their reasoning; the last turn keeps it and it is supervised
    assert spans(tok, on.render(THINK_CONV)) == ["hello there<|im_end|>", "<think>\nadd them\n</think>\n\n4<|im_end|>"]
    # thinking on, answer without reasoning: the template writes an empty think block the model generates
    plain = [dict(m) for m in THINK_CONV]
    plain[1]["content"], plain[3]["content"] = "hello there", "4"
    assert spans(tok, on.render(plain)) == ["hello there<|im_end|>", "<think>\n\n</think>\n\n4<|im_end|>"]
    # thinking off: the empty think block is part of the prompt, not of the answer
    off = ChatRenderer(tok, max_length=512, thinking=False)
    assert off.prompt_ids(plain[:3])[-4:] == tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"][-4:]
    row = off.render(plain)
    assert spans(tok, row) == ["hello there<|im_end|>", "4<|im_end|>"]
    assert "<think>\n\n</think>\n\n4" in tok.decode(row.input_ids)


def test_truncation_and_drops(smollm2_path):
    tok = tokenizer(smollm2_path)
    full = ChatRenderer(tok, max_length=512).render(CONV)
    n_prompt = full.loss_mask.index(1)
    cut = ChatRenderer(tok, max_length=n_prompt + 2).render(CONV)
    assert cut.truncated and len(cut.input_ids) == n_prompt + 2
    assert cut.input_ids == full.input_ids[: n_prompt + 2] and sum(cut.loss_mask) == 2
    assert ChatRenderer(tok, max_length=n_prompt).render(CONV) == DROP_NO_SUPERVISED
    assert ChatRenderer(tok, max_length=64).render(CONV[:2]) == DROP_NO_ASSISTANT


def test_tokenizer_without_chat_template(smollm2_path):
    tok = tokenizer(smollm2_path)
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        ChatRenderer(tok)


HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"]


def test_harmony_turns_end_differently_and_last_turn_reasoning_is_supervised(smollm2_path):
    """gpt-oss's harmony format: earlier answers end with <|end|>, the last with <|return|>; the last turn's
    analysis-channel reasoning is generated in the same turn, so it is supervised with its answer."""
    tok = tokenizer(smollm2_path, "harmony_minimal", HARMONY_SPECIALS)
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "thinking": "add them"}]
    renderer = ChatRenderer(tok, max_length=512)
    assert (renderer._eot, renderer._eot_last) == ("<|end|>", "<|return|>")
    row = renderer.render(conv)
    assert spans(tok, row) == [
        "<|channel|>final<|message|>hello there<|end|>",
        "<|channel|>analysis<|message|>add them<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>"]
    # a conversation that ends with a user turn: every answer ends with <|end|>
    assert spans(tok, renderer.render(conv[:3])) == ["<|channel|>final<|message|>hello there<|end|>"]
    from dflash_train.data.regenerate import stop_ids

    assert stop_ids(tok, renderer) == [tok.eos_token_id, tok.convert_tokens_to_ids("<|return|>")]
