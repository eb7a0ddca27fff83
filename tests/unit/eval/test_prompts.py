"""Evaluation prompts: JSONL rows, data sources, user turns, rendering with the chat template."""

from __future__ import annotations

import json

import pytest

from dflash_train.errors import DataError
from dflash_train.eval.prompts import load_labelled_prompts, load_prompts, render_prompts, user_turns


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_user_turns_stop_at_the_first_assistant_turn():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    assert user_turns(msgs) == msgs[:2]


def test_jsonl_with_prompt_and_messages(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": "Hi there"},
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                      {"role": "user", "content": "Q2"}]},
        {"prompt": "third", "system": "be nice"},
    ])
    prompts = load_prompts(str(path))
    assert prompts == [[{"role": "user", "content": "Hi there"}],
                       [{"role": "user", "content": "Q"}],
                       [{"role": "system", "content": "be nice"}, {"role": "user", "content": "third"}]]
    assert len(load_prompts(str(path), max_samples=2)) == 2


def test_jsonl_errors_name_the_line(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"text": "no"}])
    with pytest.raises(DataError, match=r"p.jsonl: line 2 has keys \['text'\]"):
        load_prompts(str(path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        load_prompts(str(bad))


def test_other_sources_go_through_the_data_loader(tmp_path):
    # ShareGPT-style file: not a prompt JSONL, read by dflash_train.data.sources
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi!"}]},
        {"conversations": [{"from": "gpt", "value": "orphan"}]},
        {"conversations": [{"from": "human", "value": "second"}, {"from": "gpt", "value": "ok"}]},
    ]))
    prompts = load_prompts(str(path))
    assert prompts == [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "second"}]]
    assert load_prompts(str(path), max_samples=1) == prompts[:1]


def test_render_uses_the_target_template_with_generation_prompt(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    (ids,) = render_prompts(tok, [msgs])
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert "What is 2+2?" in text and "4<|im_end|>" not in text


def test_binary_prompt_files_are_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n' + bytes([0xff, 0xfe, 0x00, 0x81]) * 10)
    with pytest.raises(DataError, match=r"--prompts .*p.jsonl: not UTF-8 text \(byte 0xff at offset 17\)"):
        load_prompts(str(path))


def test_source_labels_from_jsonl_rows(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2?", "source": "math"}, {"prompt": "hi"},
                                         {"prompt": "x", "source": ""}, {"prompt": "3*3?", "source": "math"}])
    labelled = load_labelled_prompts(str(path))
    assert [label for _, label in labelled] == ["math", None, None, "math"]
    assert [m for m, _ in labelled] == load_prompts(str(path))


def test_source_labels_from_held_out_rows_with_a_source_column(tmp_path, smollm2_path):
    from transformers import AutoTokenizer

    from dflash_train.data.prepare import load_prepared, write_prepared

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(4)]
    write_prepared(convs, tok, tmp_path / "rows", {"command": "test"}, max_length=64)
    ds = load_prepared(tmp_path / "rows").add_column("source", ["chat", "code", "chat", "code"])
    ds.save_to_disk(str(tmp_path / "mixed"))
    holdout = tmp_path / "run" / "holdout_rows.json"
    holdout.parent.mkdir()
    holdout.write_text(json.dumps({"data": str(tmp_path / "mixed"), "rows": [3, 0], "num_rows": 4}))
    labelled = load_labelled_prompts(str(holdout.parent))
    # the sources take turns (in label order), each keeping its rows' order
    assert labelled == [([{"role": "user", "content": "q0"}], "chat"), ([{"role": "user", "content": "q3"}], "code")]
    # a prepared folder without the column: no labels
    holdout.write_text(json.dumps({"data": str(tmp_path / "rows"), "rows": [1], "num_rows": 4}))
    assert load_labelled_prompts(str(holdout.parent)) == [([{"role": "user", "content": "q1"}], None)]
