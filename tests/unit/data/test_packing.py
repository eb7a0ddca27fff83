"""Packing documents into one row, and moving host tensors to the training device."""

import pytest
import torch

from dflash_train.data.packing import Document, pack_documents, to_device


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
