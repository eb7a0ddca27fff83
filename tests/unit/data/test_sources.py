"""Data sources: schemas, shipped datasets, local files and folders, bad input."""

from __future__ import annotations

import json

import pytest

from dflash_train.data.sources import load_conversations, normalize_record
from dflash_train.errors import DataError


def test_shipped_sharegpt_keeps_every_complete_record():
    convs = load_conversations("sharegpt")
    assert len(convs) == 17_671  # the file is cut mid-record; everything before the cut survives
    roles = {m["role"] for c in convs for m in c}
    assert roles <= {"system", "user", "assistant"}
    first = convs[0]
    assert first[0]["role"] == "user" and first[1]["role"] == "assistant"
    assert first[0]["content"].startswith("Summarize the main ideas of Jeff Walker")
    # merged and cleaned: never two messages of one role in a row, never an empty message
    for c in convs[:2000]:
        assert all(a["role"] != b["role"] for a, b in zip(c, c[1:], strict=False))
        assert all(m["content"].strip() for m in c)


def test_shipped_chitchat_alternates_speakers():
    convs = load_conversations("chitchat", max_samples=50)
    assert len(convs) == 50
    assert all(c[0]["role"] == "user" for c in convs)
    multi = [c for c in convs if len(c) > 1]
    assert multi and all(m["role"] == ("user" if i % 2 == 0 else "assistant")
                         for c in multi for i, m in enumerate(c))


RECORDS = [
    {"messages": [{"role": "system", "content": "Be short."}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}]},
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                       {"from": "human", "value": "and 3+3?"}, {"from": "human", "value": "quick"},
                       {"from": "gpt", "value": "6"}]},
    {"prompt": "Name a color.", "response": "Blue.", "system": "You like colors."},
    {"instruction": "Translate", "input": "bonjour", "output": "hello"},
    {"question": "Capital of France?", "answer": "Paris"},
]
EXPECTED = [
    [("system", "Be short."), ("user", "hi"), ("assistant", "hello")],
    [("user", "2+2?"), ("assistant", "4"), ("user", "and 3+3?\n\nquick"), ("assistant", "6")],
    [("system", "You like colors."), ("user", "Name a color."), ("assistant", "Blue.")],
    [("user", "Translate\n\nbonjour"), ("assistant", "hello")],
    [("user", "Capital of France?"), ("assistant", "Paris")],
]


def _pairs(convs):
    return [[(m["role"], m["content"]) for m in c] for c in convs]


@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet"])
def test_local_files_every_schema(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(RECORDS))
    elif fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        # one schema per parquet file, read together as a folder
        path = tmp_path / "folder"
        path.mkdir()
        records = json.loads(json.dumps(RECORDS))
        records[0]["messages"][2]["content"] = "hello"  # arrow needs one type per column
        for i, r in enumerate(records):
            pq.write_table(pa.Table.from_pylist([r]), path / f"part-{i}.parquet")
    assert _pairs(load_conversations(str(path))) == EXPECTED
    assert len(load_conversations(str(path), max_samples=2)) == 2


def test_unknown_schema_names_columns_and_schemas(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "hello", "label": 1}) + "\n")
    with pytest.raises(DataError) as err:
        load_conversations(str(path))
    msg = str(err.value)
    assert "['label', 'text']" in msg and "messages" in msg and "conversations" in msg and "prompt" in msg


def test_bad_inputs(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        load_conversations(str(empty))
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(RECORDS)[:-30])
    with pytest.raises(DataError, match="invalid JSON"):
        load_conversations(str(cut))
    with pytest.raises(DataError, match="not found"):
        load_conversations(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="role 'robot'"):
        normalize_record({"messages": [{"role": "robot", "content": "x"}]})
    with pytest.raises(DataError, match="no .json"):
        (tmp_path / "nothing").mkdir()
        load_conversations(str(tmp_path / "nothing"))


def test_leading_assistant_is_dropped_and_no_assistant_is_kept():
    msgs = normalize_record({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"},
                                          {"role": "user", "content": "u"}]})
    assert [m["role"] for m in msgs] == ["system", "user"]


def test_binary_and_garbage_files_are_named(tmp_path):
    import random

    rng = random.Random(0)
    noise = bytes(rng.randrange(256) for _ in range(4096))
    (tmp_path / "bin.jsonl").write_bytes(b"\x89PNG" + noise)
    with pytest.raises(DataError, match=r"--data .*bin.jsonl: not UTF-8 text \(byte 0x89 at offset 0\); give JSON"):
        load_conversations(str(tmp_path / "bin.jsonl"))
    (tmp_path / "junk.parquet").write_bytes(noise)
    with pytest.raises(DataError, match=r"--data .*junk.parquet: not a readable Parquet file \(.*magic bytes"):
        load_conversations(str(tmp_path / "junk.parquet"))
    # a real Parquet file cut short is refused the same way
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a"] * 50, "response": ["b"] * 50}), tmp_path / "ok.parquet")
    assert len(load_conversations(str(tmp_path / "ok.parquet"))) == 50
    data = (tmp_path / "ok.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="cut.parquet: not a readable Parquet file"):
        load_conversations(str(tmp_path / "cut.parquet"))
