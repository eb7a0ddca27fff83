"""prepare_dataset: output folder, summary counts, token frequencies, cache reuse, bad input."""

from __future__ import annotations

import json

import pytest

from dflash_train.data.prepare import SUMMARY_FILE, load_prepared, prepare_dataset
from dflash_train.data.vocab import read_token_freq
from dflash_train.errors import DataError

LONG = "word " * 400
CONVS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                       {"from": "human", "value": "3+3?"}, {"from": "gpt", "value": "6"}]},
    {"messages": [{"role": "user", "content": "nobody answers"}]},
    {"prompt": LONG, "response": "too late"},  # the answer starts after max_length
    {"prompt": "long answer please", "response": LONG},  # truncated but kept
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_prepare_writes_dataset_freqs_and_summary(tmp_path, smollm2_path):
    src = write_jsonl(tmp_path / "chats.jsonl", CONVS)
    out = tmp_path / "prepared"
    summary = prepare_dataset(None, src, out, max_length=96)
    assert summary["rows"] == 3 and summary["rows_in"] == 5
    assert summary["rows_dropped"] == {"no_assistant_turn": 1, "no_supervised_tokens_after_truncation": 1}
    assert summary["rows_truncated"] == 1
    ds = load_prepared(out)
    assert set(ds.column_names) >= {"input_ids", "loss_mask", "messages"} and len(ds) == 3
    assert all(len(r) <= 96 for r in ds["input_ids"])
    assert all(set(m) <= {0, 1} for m in ds["loss_mask"])
    assert json.loads(ds[1]["messages"])[-1] == {"role": "assistant", "content": "6"}
    # token frequencies count exactly the supervised tokens
    counts = read_token_freq(out)
    sup = [t for ids, m in zip(ds["input_ids"], ds["loss_mask"], strict=True) for t, k in zip(ids, m, strict=True) if k]
    assert int(counts.sum()) == len(sup) == summary["supervised_tokens"]
    # <|im_end|> closes every turn but the truncated one
    assert int(counts[2]) == sum(1 for t in sup if t == 2) == 3
    assert summary["tokens"] == sum(len(r) for r in ds["input_ids"])
    on_disk = json.loads((out / SUMMARY_FILE).read_text())
    assert on_disk["target"] == str(smollm2_path) and on_disk["inputs"]["max_length"] == 96

    # same inputs: reused, not rewritten; other inputs: refused, then rewritten with overwrite
    stamp = (out / "dataset_info.json").stat().st_mtime_ns
    again = prepare_dataset(None, src, out, max_length=96)
    assert again.get("cached") and (out / "dataset_info.json").stat().st_mtime_ns == stamp
    from dflash_train.errors import OutputError

    with pytest.raises(OutputError, match="--output .*earlier dflash-toolkit output .*--overwrite"):
        prepare_dataset(None, src, out, max_length=600)
    assert (out / "dataset_info.json").stat().st_mtime_ns == stamp
    other = prepare_dataset(None, src, out, max_length=600, overwrite=True)
    assert not other.get("cached") and other["rows"] == 4
    assert json.loads((out / "prepare_summary.json").read_text())["inputs"]["max_length"] == 600


def test_all_rows_dropped_is_an_error_and_writes_nothing(tmp_path):
    src = write_jsonl(tmp_path / "none.jsonl", [CONVS[2], CONVS[2]])
    with pytest.raises(DataError, match="all 2 were dropped"):
        prepare_dataset(None, src, tmp_path / "out", max_length=64)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["none.jsonl"]


def test_load_prepared_rejects_bad_folders(tmp_path):
    import datasets

    with pytest.raises(DataError, match="not a prepared dataset"):
        load_prepared(tmp_path)
    datasets.Dataset.from_dict({"input_ids": [[1, 2]]}).save_to_disk(str(tmp_path / "no_mask"))
    with pytest.raises(DataError, match=r"missing column\(s\) \['loss_mask'\]"):
        load_prepared(tmp_path / "no_mask")


def test_max_turns_keeps_the_first_exchanges(tmp_path, smollm2_path):
    src = write_jsonl(tmp_path / "chats.jsonl", CONVS)
    one = prepare_dataset(None, src, tmp_path / "one", max_length=96, max_turns=1)
    ds = load_prepared(tmp_path / "one")
    assert json.loads(ds[1]["messages"]) == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert one["inputs"]["max_turns"] == 1
    prepare_dataset(None, src, tmp_path / "full", max_length=96)
    full = load_prepared(tmp_path / "full")
    assert len(full[1]["input_ids"]) > len(ds[1]["input_ids"])  # the second exchange is gone
    with pytest.raises(DataError, match="--max-turns must be >= 1"):
        prepare_dataset(None, src, tmp_path / "bad", max_turns=0)


def test_mixed_sources_are_labelled_and_capped_each(tmp_path, smollm2_path):
    chats = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
             for i in range(5)]
    code = [{"prompt": f"write f{i}", "response": f"def f{i}(): pass"} for i in range(3)]
    a, b = write_jsonl(tmp_path / "chat.jsonl", chats), write_jsonl(tmp_path / "code.jsonl", code)
    out = tmp_path / "mixed"
    summary = prepare_dataset(None, [a, b], out, max_samples=4, max_length=96)
    ds = load_prepared(out)
    assert ds["source"] == ["chat"] * 4 + ["code"] * 3  # --max-samples caps each source
    assert summary["rows_by_source"] == {"chat": 4, "code": 3}
    assert json.loads(ds[4]["messages"])[0]["content"] == "write f0"
    assert prepare_dataset(None, [a, b], out, max_samples=4, max_length=96).get("cached")
    # one source: no label column, as before
    assert "source" not in load_prepared(prepare_dataset(None, a, tmp_path / "one", max_length=96)
                                         and tmp_path / "one").column_names
    with pytest.raises(DataError, match="--data: two sources share the label"):
        prepare_dataset(None, [a, str(tmp_path / "sub" / "chat.jsonl")], tmp_path / "dup", max_length=96)


def test_combine_concatenates_labelled_parts_and_sums_token_counts(tmp_path, smollm2_path):
    from dflash_train.data.prepare import combine_prepared

    parts = []
    for name, n in (("chat", 3), ("math", 2)):
        src = write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": f"{name} {i}?", "response": f"answer {i}"}
                                                     for i in range(n)])
        prepare_dataset(None, src, tmp_path / name, max_length=64, label=name)
        parts.append(tmp_path / name)
    out = tmp_path / "both"
    summary = combine_prepared(parts, out, {"command": "combine", "parts": [str(p) for p in parts]})
    ds = load_prepared(out)
    assert ds["source"] == ["chat"] * 3 + ["math"] * 2 and summary["rows_by_source"] == {"chat": 3, "math": 2}
    expected = sum(read_token_freq(p) for p in parts)
    assert read_token_freq(out).tolist() == expected.tolist() and summary["supervised_tokens"] == int(expected.sum())
    stamp = (out / "dataset_info.json").stat().st_mtime_ns
    assert combine_prepared(parts, out, {"command": "combine", "parts": [str(p) for p in parts]}).get("cached")
    assert (out / "dataset_info.json").stat().st_mtime_ns == stamp
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "q", "response": "a"}])
    prepare_dataset(None, plain, tmp_path / "plain", max_length=64)
    with pytest.raises(DataError, match=r"--data .*plain: rows carry no `source` label"):
        combine_prepared([parts[0], tmp_path / "plain"], tmp_path / "bad", {"command": "combine"})
    assert not (tmp_path / "bad").exists()


def test_rows_cut_at_max_length_are_counted_and_said_once(tmp_path, smollm2, capfd):
    """A 2-million-character answer under --max-length 128 keeps its row cut to 128 tokens, and one
    `warning:` line says how many rows were cut and by how much (the counts also in the summary)."""
    huge = "word " * 400_000
    records = [{"prompt": "long answer please", "response": huge}, *CONVS[:2]]
    src = write_jsonl(tmp_path / "huge.jsonl", records)
    summary = prepare_dataset(None, src, tmp_path / "out", max_length=128)
    text = smollm2[1].apply_chat_template([{"role": "user", "content": "long answer please"},
                                           {"role": "assistant", "content": huge}], tokenize=False)
    full = len(smollm2[1](text, add_special_tokens=False)["input_ids"])
    assert summary["rows_truncated"] == 1 and summary["max_tokens_truncated"] == summary["tokens_truncated"]
    assert abs(summary["tokens_truncated"] - (full - 128)) <= 2  # the template's closing newline at most
    assert max(len(r) for r in load_prepared(tmp_path / "out")["input_ids"]) == 128
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: --max-length 128 cut 1 of 3 rows ({summary['tokens_truncated']:,} tokens in all, "
                        f"up to {summary['tokens_truncated']:,} from one row); what they lost is not trained on. "
                        "Raise --max-length to keep more of them"]
    assert prepare_dataset(None, src, tmp_path / "out", max_length=128)["rows_truncated"] == 1  # cached: said once
    assert not [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
