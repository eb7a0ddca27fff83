"""Packing documents into one row, and moving host tensors to the training device."""

import pytest
import torch

from dflash_train.data.packing import EXTRA_CALL_SHARE, Document, pack_documents, padded_groups, to_device


def _docs():
    g = torch.Generator().manual_seed(0)
    return [Document(torch.arange(n), torch.ones(n, dtype=torch.bool), torch.randn(n, 6, generator=g),
                     torch.arange(n) + 1) for n in (5, 3)]


def test_pack_keeps_documents_apart():
    docs = _docs()
    p = pack_documents(docs, pin_memory=True)  # no CUDA here: pinning is skipped, values are the same
    assert p.doc_ids.tolist() == [0] * 5 + [1] * 3 and p.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert p.doc_start.tolist() == [0] * 5 + [5] * 3 and p.doc_end.tolist() == [5] * 5 + [8] * 3
    assert torch.equal(p.features, torch.cat([d.features for d in docs]))
    assert p.features.is_pinned() == torch.cuda.is_available()


def test_to_device_is_the_identity_on_the_same_device():
    t = torch.randn(3)
    assert to_device(t, "cpu") is t and to_device(t, torch.device("cpu")) is t
    assert to_device(t, "meta").device.type == "meta"


@pytest.mark.gpu
def test_host_tensors_reach_the_gpu_through_pinned_memory():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    p = pack_documents(_docs(), pin_memory=True)
    assert p.features.is_pinned()
    moved = to_device(p.features, "cuda")
    assert moved.is_cuda and torch.equal(moved.cpu(), p.features)
    unpinned = torch.randn(4, 4)
    assert torch.equal(to_device(unpinned, "cuda").cpu(), unpinned)


def _cost(lengths, groups, call):
    return sum(len(g) * max(lengths[i] for i in g) + call for g in groups)


def _partitions(order):
    """Every split of `order` into consecutive runs."""
    if not order:
        yield []
        return
    for k in range(1, len(order) + 1):
        for rest in _partitions(order[k:]):
            yield [order[:k], *rest]


@pytest.mark.parametrize("seed", range(6))
def test_padded_groups_cost_no_more_than_any_split_of_the_sorted_rows(seed):
    """Against every split of the longest-first order (2^(n-1) of them), and against any other grouping
    tried at random: no grouping of the rows pads less for as many forwards."""
    import random

    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(8, 40), rng.randint(300, 3000)]) for _ in range(rng.randint(1, 9))]
    call = EXTRA_CALL_SHARE * sum(lengths)
    groups = padded_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # each row once
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    best = min(_cost(lengths, p, call) for p in _partitions(order))
    assert _cost(lengths, groups, call) == pytest.approx(best)
    for _ in range(200):  # any grouping at all, not only runs of the sorted order
        labels = [rng.randrange(len(lengths)) for _ in lengths]
        other = [[i for i, lab in enumerate(labels) if lab == k] for k in set(labels)]
        assert _cost(lengths, groups, call) <= _cost(lengths, other, call) + 1e-9


def test_padded_groups_split_only_where_padding_costs_more_than_a_forward():
    assert padded_groups([100, 100, 100]) == [[0, 1, 2]]  # nothing to save
    assert padded_groups([3000, 20, 2900, 30], extra_call_tokens=float("inf")) == [[0, 2, 3, 1]]
    assert padded_groups([3000, 20, 2900, 30]) == [[0, 2], [3, 1]]  # 4 x 3000 against 2 x 3000 + 2 x 30
    assert padded_groups([3000, 20, 2900, 30], extra_call_tokens=0) == [[0], [2], [3], [1]]
    assert padded_groups([]) == []
