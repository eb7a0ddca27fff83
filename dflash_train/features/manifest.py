"""A feature cache's manifest: the target's fingerprint, reading and checking `manifest.json`, and which
finished shards of an interrupted write a rerun with the same inputs keeps (cache.py writes and reads
the shards)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dflash_train.errors import DataError
from dflash_train.features.cache_writer import FORMAT

MANIFEST_FILE = "manifest.json"
INPUT_KEYS = ("target_revision", "target_layer_ids", "dtype", "rows_per_shard", "data_fingerprint", "num_rows",
               "topk", "target_dtype", "greedy_next", "topk_vocab")


def target_revision(path: str | Path) -> str:
    """A cheap fingerprint of a local target: config.json and each weight file's size, head and tail."""
    path = Path(path)
    if not path.is_dir():
        return str(path)  # a hub id: its name is all we know offline
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.suffix in (".safetensors", ".bin"):
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 16))
                fh.seek(max(0, size - (1 << 16)))
                h.update(fh.read(1 << 16))
    return h.hexdigest()[:16]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def resumable_shards(out: Path, manifest: dict) -> list[dict]:
    """Finished shards of an earlier run with the same inputs; raises if the inputs differ."""
    path = out / MANIFEST_FILE
    if not path.is_file():
        return []
    # caches from before top-k have none; those from before target_dtype was recorded computed in the
    # device's default, which is what an unchanged recipe asks for again; all older ones hold greedy tokens
    old = {"topk": 0, "target_dtype": manifest["target_dtype"], "greedy_next": True, "topk_vocab": None,
           **read_manifest(out)}
    diff = [k for k in INPUT_KEYS if old.get(k) != manifest.get(k)]
    if diff:
        raise DataError(f"{path}: this folder holds features from other inputs ("
                        + ", ".join(f"{k}: {old.get(k)!r} there, {manifest.get(k)!r} now" for k in diff)
                        + "); pick another --output or delete the folder")
    kept = []
    for s in sorted(old.get("shards", []), key=lambda s: s["file"]):
        f = out / s["file"]
        if f.is_file() and f.stat().st_size == s["bytes"] and sha256_file(f) == s["sha256"]:
            kept.append(s)
    n_shards = (manifest["num_rows"] + manifest["rows_per_shard"] - 1) // manifest["rows_per_shard"]
    manifest["complete"] = len(kept) == n_shards
    return kept


def read_manifest(path: Path) -> dict:
    f = path / MANIFEST_FILE
    if not f.is_file():
        raise DataError(f"{path}: no {MANIFEST_FILE}; not a feature cache (write one with `dflash-train features`)")
    try:
        m = json.loads(f.read_text())
    except ValueError as exc:
        raise DataError(f"{f}: not valid JSON ({exc}); delete the cache and rerun `dflash-train features`") from exc
    if m.get("format") != FORMAT:
        raise DataError(f"{f}: format is {m.get('format')!r}, expected {FORMAT!r}")
    return m
