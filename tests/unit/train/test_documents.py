"""Memory-mode documents: features computed up front (length-sorted batches) equal the lazy ones."""

import torch

from dflash_train.features.target import load_target
from dflash_train.train.documents import DocumentSource, load_rows


def test_warm_computes_every_row_once_and_matches_lazy_features(train_tiny_target, train_prepared, monkeypatch):
    model, _ = load_target(str(train_tiny_target), dtype=torch.float32, device="cpu")
    rows = load_rows(train_prepared)
    idx = [3, 0, 7, 5, 11]
    lazy = DocumentSource(rows, "memory", model, [1, 3, 5], target_hidden=64)
    warm = DocumentSource(rows, "memory", model, [1, 3, 5], target_hidden=64)
    warm.warm(idx, tokens_per_batch=2 * max(warm.lengths), progress=False)  # batches of two rows
    assert sorted(warm._memory) == sorted(idx)

    def no_compute(_idx):
        raise AssertionError(f"rows {_idx} were computed again")

    monkeypatch.setattr(warm, "_compute", no_compute)
    got, _ = warm.get(idx)
    ref, _ = lazy.get(idx)
    for g, r, i in zip(got, ref, idx, strict=True):
        assert len(g) == len(rows[i]["input_ids"])
        torch.testing.assert_close(g.features.float(), r.features.float(), rtol=0, atol=2e-2)  # bf16 storage
        assert torch.equal(g.greedy_next, r.greedy_next)
        assert torch.equal(g.input_ids, r.input_ids)


def test_warm_is_a_no_op_outside_memory_mode(train_tiny_target, train_prepared):
    model, _ = load_target(str(train_tiny_target), dtype=torch.float32, device="cpu")
    source = DocumentSource(load_rows(train_prepared), "online", model, [1, 3, 5], target_hidden=64)
    source.warm([0, 1], progress=False)
    assert source._memory == {}


def test_fractions_of_training_rows_are_nested_and_keep_each_source_share():
    from dflash_train.train.documents import fraction_of_rows

    rows = list(range(0, 400, 2))  # 200 training rows
    labels = ["chat" if i < 300 else "code" for i in range(400)]  # 150 chat, 50 code
    quarter, half = (fraction_of_rows(rows, f, seed=0, labels=labels) for f in (0.25, 0.5))
    assert len(quarter) == 50 and len(half) == 100 and set(quarter) <= set(half) <= set(rows)
    assert sum(labels[i] == "code" for i in quarter) == 12 and sum(labels[i] == "code" for i in half) == 25
    assert fraction_of_rows(rows, 1.0, seed=0) == rows
    assert fraction_of_rows(rows, 0.5, seed=1, labels=labels) != half  # seeded


def test_a_mixture_is_prepared_per_source_and_reuses_each_source(tmp_path, train_tiny_target):
    import json

    from dflash_train.train.documents import prepared_rows
    from dflash_train.train.recipe import DataConfig

    for name, n in (("chat", 4), ("code", 3)):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"prompt": f"{name} {i}?", "response": f"answer {i}"}) + "\n" for i in range(n)))

    def mixture(code_samples):
        return DataConfig(source=[{"source": str(tmp_path / "chat.jsonl")},
                                  {"source": str(tmp_path / "code.jsonl"), "max_samples": code_samples}],
                          max_length=64, cache_dir=str(tmp_path / "cache"))

    path = prepared_rows(mixture(3), str(train_tiny_target), seed=0)
    rows = load_rows(path)
    assert rows["source"] == ["chat"] * 4 + ["code"] * 3
    chat_parts = [p for p in (tmp_path / "cache" / "sources").iterdir()
                  if load_rows(p / "prepared")["source"][0] == "chat"]
    stamp = (chat_parts[0] / "prepared" / "dataset_info.json").stat().st_mtime_ns
    other = prepared_rows(mixture(2), str(train_tiny_target), seed=0)
    assert other != path and load_rows(other)["source"] == ["chat"] * 4 + ["code"] * 2
    # the chat source was prepared once: the second mixture reused it
    assert len([p for p in (tmp_path / "cache" / "sources").iterdir()]) == 3
    assert (chat_parts[0] / "prepared" / "dataset_info.json").stat().st_mtime_ns == stamp
