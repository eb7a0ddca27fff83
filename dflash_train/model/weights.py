"""Safetensors weights on disk: streamed reads shard by shard, atomic sharded writes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_train.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MASK_EMBEDDING_FILE = "mask_embedding.pt"  # a drafter's own mask embedding (model/checkpoint.py)
# vLLM reads that file; what to say where a drafter that has it goes to SGLang (a z-lab copy, `dflash-serve --engine sglang`)
SGLANG_MASK_NOTE = (f"{MASK_EMBEDDING_FILE} (the drafter's trained mask embedding) copied along, but SGLang borrows the "
                    "target's embedding row of mask_token_id and never reads it: it serves this drafter with another "
                    "input at the mask slots than it was trained with (lower acceptance). vLLM reads it: serve the "
                    "speculators format")
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in index order."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (folder / name).is_file():
                raise CheckpointError(f"{index}: names shard {name}, which is missing from {folder}")
        return [folder / name for name in files]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    found = sorted(folder.glob("*.safetensors"))
    if len(found) == 1:
        return found
    raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}; not a checkpoint folder")


def iter_shards(folder: Path) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    """Yield (file, tensors) one shard at a time, so peak memory is one shard."""
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                yield path, {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:  # safetensors raises its own error types for truncated files
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{path}: unreadable safetensors file ({exc}); re-save or re-download it") from exc


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for _, shard in iter_shards(folder):
        tensors.update(shard)
    return tensors


def tensor_shapes(folder: Path) -> dict[str, tuple[list[int], str]]:
    """Names, shapes and dtypes without loading tensor data."""
    out = {}
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    out[name] = (list(sl.get_shape()), sl.get_dtype())
        except Exception as exc:
            raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_tensors(folder: Path, tensors: Mapping[str, torch.Tensor],
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write tensors into `folder` (which should be a fresh temp folder); shard above the limit."""
    folder = Path(folder)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        if shards[-1] and size + _nbytes(t) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += _nbytes(t)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / SINGLE_FILE), metadata=meta)
        return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(folder / name), metadata=meta)
        weight_map.update({k: name for k in shard})
    total = sum(_nbytes(t) for s in shards for t in s.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                 "weight_map": weight_map}, indent=2))
    return names + [INDEX_FILE]


def write_json(path: Path, data) -> None:
    """Write JSON atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
