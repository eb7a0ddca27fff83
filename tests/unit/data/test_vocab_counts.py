"""Draft-vocabulary counts over the training rows only (dflash_train/data/vocab.py)."""

import torch

from dflash_train.data.prepare import load_prepared
from dflash_train.data.vocab import (
    count_token_frequencies,
    read_token_freq,
    reduced_vocab_maps,
    training_token_frequencies,
)


def _direct(rows, keep):
    return count_token_frequencies([(rows[i]["input_ids"], rows[i]["loss_mask"]) for i in keep], 49152)


def test_training_counts_are_the_kept_rows_whichever_side_is_counted(train_prepared):
    rows = load_prepared(train_prepared)
    total = read_token_freq(train_prepared)
    n = len(rows)
    few, most = [0, 3, 5], [i for i in range(n) if i not in (1, 3)]  # counted directly; the rest subtracted
    for keep in (few, most):
        assert torch.equal(training_token_frequencies(rows, keep, total), _direct(rows, keep))
    assert torch.equal(training_token_frequencies(rows, list(range(n)), total), total)


def test_ids_only_the_left_out_answers_use_never_make_the_vocabulary(train_prepared):
    rows = load_prepared(train_prepared)
    keep = [0, 3, 5]  # answers with the digits 0, 1, 3, 5, 6, 8 and 9: the other rows' use 2, 4 and 7 too
    counts = training_token_frequencies(rows, keep, read_token_freq(train_prepared))
    only_left = (_direct(rows, [i for i in range(len(rows)) if i not in keep]) > 0) & (counts == 0)
    assert only_left.sum() == 3
    kept = reduced_vocab_maps(counts, int((counts > 0).sum()))[1]
    assert torch.equal(kept, counts > 0) and not kept[only_left].any()
    assert reduced_vocab_maps(read_token_freq(train_prepared), int((counts > 0).sum()))[1][only_left].any()


def test_counts_cover_the_targets_spare_rows_with_zeros():
    """Prepare counts the tokenizer's ids; a Qwen target has 271 embedding rows more: they count 0."""
    import pytest
    import torch

    from dflash_train.data.vocab import counts_for_vocab, reduced_vocab_maps
    from dflash_train.errors import DataError

    counts = torch.tensor([0, 5, 0, 2, 9])
    full = counts_for_vocab(counts, 8, "token_freq.json")
    assert full.tolist() == [0, 5, 0, 2, 9, 0, 0, 0]
    d2t, t2d = reduced_vocab_maps(full, 4)
    assert t2d.shape == (8,) and (torch.arange(4) + d2t).tolist() == [0, 1, 3, 4]  # spare rows only as a last resort
    with pytest.raises(DataError, match="token_freq.json: counts cover 5 ids but the target has 4 embedding rows"):
        counts_for_vocab(counts, 4, "token_freq.json")
