"""The streaming safetensors reader/writer against the reference safetensors library."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.errors import CheckpointError
from dflash_train.model.stream import OutTensor, folder_refs, read_header, write_streaming


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.int64),
            "c": torch.tensor([True, False, True]), "d": torch.randn(4, generator=g, dtype=torch.float32),
            "e": torch.randn(2, 2, generator=g).half()}


def test_streaming_write_is_read_back_by_safetensors(tmp_path):
    src = _tensors()
    files = write_streaming(tmp_path, [OutTensor.of(k, v) for k, v in src.items()], max_shard_bytes=1 << 30)
    assert files == ["model.safetensors"]
    back = load_file(str(tmp_path / "model.safetensors"))
    assert set(back) == set(src)
    for k in src:
        assert back[k].dtype == src[k].dtype and torch.equal(back[k], src[k])


def test_sharding_and_reading_refs(tmp_path):
    src = _tensors()
    files = write_streaming(tmp_path, [OutTensor.of(k, v) for k, v in src.items()], max_shard_bytes=24)
    assert files[-1] == "model.safetensors.index.json" and len(files) > 3
    refs = {r.name: r for r in folder_refs(tmp_path)}
    for k in src:
        assert torch.equal(refs[k].read(), src[k])


def test_reference_file_read_one_tensor_at_a_time(tmp_path):
    src = _tensors()
    save_file(src, str(tmp_path / "model.safetensors"))
    _, refs = read_header(tmp_path / "model.safetensors")
    assert {r.name: r.read() for r in refs}.keys() == src.keys()
    assert all(torch.equal(r.read(), src[r.name]) for r in refs)


def test_truncated_file_is_reported(tmp_path):
    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-9])
    with pytest.raises(CheckpointError, match="truncated"):
        read_header(path)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        read_header(path)
