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
    got = warm.get(idx)
    ref = lazy.get(idx)
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
