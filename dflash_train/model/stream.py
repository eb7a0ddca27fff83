"""Safetensors read and written one tensor at a time, without mmap.

The header of a safetensors file names every tensor's dtype, shape and byte range, so a
converter can plan the output files from headers alone and then move one tensor at a time:
peak memory is the largest single tensor, not a shard (and never the whole checkpoint).
Reading with plain `read()` instead of mmap keeps the file out of the process's resident set.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train.errors import CheckpointError

from .weights import INDEX_FILE, SINGLE_FILE, weight_files

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes live: file, dtype code, shape, absolute byte range."""
    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def read(self) -> torch.Tensor:
        if self.dtype not in DTYPES:
            raise CheckpointError(f"{self.file}: tensor `{self.name}` has unsupported dtype {self.dtype}")
        buf = torch.empty(self.nbytes, dtype=torch.uint8)  # uninitialised: no zero-fill pass
        with open(self.file, "rb", buffering=0) as f:
            f.seek(self.start)
            view, got = memoryview(buf.numpy()), 0
            while got < self.nbytes:
                n = f.readinto(view[got:])
                if not n:
                    raise CheckpointError(f"{self.file}: truncated inside tensor `{self.name}`; "
                                          "re-save or re-download it")
                got += n
        return buf.view(DTYPES[self.dtype]).reshape(self.shape)


def read_header(path: Path) -> tuple[dict, list[TensorRef]]:
    """(metadata, tensor refs) of one file; raises CheckpointError if it is not whole."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file; re-save or re-download it")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{path}: header length {n} exceeds the file ({size} bytes); the file is truncated")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from exc
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    refs = []
    end_max = 0
    for name, info in header.items():
        try:
            start, end = (int(x) for x in info["data_offsets"])
            ref = TensorRef(path, name, info["dtype"], tuple(int(s) for s in info["shape"]), base + start, base + end)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: bad header entry for tensor `{name}` ({exc})") from exc
        refs.append(ref)
        end_max = max(end_max, ref.end)
    if end_max > size:
        raise CheckpointError(f"{path}: header promises {end_max} bytes but the file has {size}; "
                              "the file is truncated, re-save or re-download it")
    return meta, sorted(refs, key=lambda r: r.start)


def folder_refs(folder: Path) -> list[TensorRef]:
    """Every tensor of a checkpoint folder, from headers only (no tensor data read)."""
    refs: list[TensorRef] = []
    for path in weight_files(folder):
        refs.extend(read_header(path)[1])
    return refs


def iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time across all shards."""
    for ref in folder_refs(folder):
        yield ref.name, ref.read()


@dataclass(frozen=True)
class OutTensor:
    """One tensor of an output checkpoint: its dtype/shape and how to produce its bytes."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * DTYPES[self.dtype].itemsize

    @classmethod
    def copy_of(cls, ref: TensorRef, name: str | None = None) -> OutTensor:
        return cls(name or ref.name, ref.dtype, ref.shape, ref.read)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> OutTensor:
        t = tensor.detach().contiguous().cpu()
        return cls(name, CODES[t.dtype], tuple(t.shape), lambda: t)


def _write_file(path: Path, tensors: list[OutTensor], on_bytes: Callable[[int], None] | None) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors:
            value = t.produce()
            if tuple(value.shape) != t.shape or CODES.get(value.dtype) != t.dtype:
                raise CheckpointError(f"tensor `{t.name}`: produced {value.dtype} {list(value.shape)}, "
                                      f"planned {t.dtype} {list(t.shape)}")
            flat = value.contiguous().reshape(-1)
            if flat.numel():
                f.write(memoryview(flat.view(torch.uint8).numpy()))
            if on_bytes:
                on_bytes(t.nbytes)
            del value, flat


def shard_plan(tensors: Iterable[OutTensor], max_shard_bytes: int) -> list[list[OutTensor]]:
    """Greedy grouping in the given order; a tensor larger than the limit gets its own shard."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_streaming(folder: Path, tensors: list[OutTensor], max_shard_bytes: int,
                    on_bytes: Callable[[int], None] | None = None) -> list[str]:
    """Write `tensors` into `folder` (a fresh temp folder); sharded with an index above the limit."""
    folder = Path(folder)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(f"output would hold tensor `{dup[0]}` twice")
    shards = shard_plan(tensors, max_shard_bytes)
    if len(shards) == 1:
        _write_file(folder / SINGLE_FILE, shards[0], on_bytes)
        return [SINGLE_FILE]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards, strict=True):
        _write_file(folder / file, shard, on_bytes)
        weight_map.update({t.name: file for t in shard})
    total = sum(t.nbytes for t in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files + [INDEX_FILE]
