"""Offline feature cache: sharded safetensors plus a manifest.

Layout of a cache folder:
- `shard-NNNNN.safetensors`, each holding a run of consecutive rows, concatenated over tokens:
  `features` [N, n*H] (bfloat16 by default), `input_ids` [N] int64, `loss_mask` [N] uint8,
  `greedy_next` [N] int64 (the target's argmax at each position), `row_offsets` [R+1] int64
  (row r is tokens row_offsets[r]:row_offsets[r+1]) and `row_index` [R] int64 (dataset rows).
- `manifest.json`: target name, path and revision, layer ids, dtype, row and token counts, the
  prepared data's path and fingerprint, and one entry per finished shard (rows, tokens, bytes,
  sha256), plus `complete`.

Writing keeps memory to one batch: a shard's layout is known before the forward passes (row
lengths come from the prepared data), so the header is written first and each batch's rows are
written at their offsets. A shard is written under a temp name and renamed when whole; the
manifest is rewritten atomically after each shard. A rerun with the same inputs after a crash
or SIGKILL keeps the finished shards (checksums verified) and computes the rest.

Reading validates each shard when first opened (size and checksum-free header checks: shapes,
dtype, offsets) and each row when read (ids and mask equal the prepared data when it is
still there, finite features).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dflash_train.data.packing import Document
from dflash_train.errors import DataError
from dflash_train.outputs import check_writable, ensure_folder, plan_output

MANIFEST_FILE = "manifest.json"
FORMAT = "dflash-feature-cache"
_DTYPES = {"bfloat16": (torch.bfloat16, "BF16"), "float16": (torch.float16, "F16"),
           "float32": (torch.float32, "F32")}
_INPUT_KEYS = ("target_revision", "target_layer_ids", "dtype", "rows_per_shard", "data_fingerprint", "num_rows")


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


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


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


# ---- writing --------------------------------------------------------------------------

class _ShardWriter:
    """One safetensors file whose layout is fixed up front; rows are written at their offsets."""

    def __init__(self, path: Path, lengths: list[int], row_index: list[int], feature_dim: int, dtype: str):
        self.path, self.feature_dim = path, feature_dim
        self.torch_dtype, st_dtype = _DTYPES[dtype]
        self.item = torch.empty((), dtype=self.torch_dtype).element_size()
        n, r = sum(lengths), len(lengths)
        self.tok_off = [0]
        for length in lengths:
            self.tok_off.append(self.tok_off[-1] + length)
        specs = [("features", st_dtype, [n, feature_dim], n * feature_dim * self.item),
                 ("input_ids", "I64", [n], 8 * n), ("loss_mask", "U8", [n], n),
                 ("greedy_next", "I64", [n], 8 * n), ("row_offsets", "I64", [r + 1], 8 * (r + 1)),
                 ("row_index", "I64", [r], 8 * r)]
        header, pos = {"__metadata__": {"format": FORMAT}}, 0
        self.base = {}
        for name, st, shape, nbytes in specs:
            header[name] = {"dtype": st, "shape": shape, "data_offsets": [pos, pos + nbytes]}
            self.base[name] = pos
            pos += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.data_start = 8 + len(blob)
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(blob)) + blob)
        self.f.truncate(self.data_start + pos)
        self._put("row_offsets", 0, torch.tensor(self.tok_off, dtype=torch.int64))
        self._put("row_index", 0, torch.tensor(row_index, dtype=torch.int64))

    def _put(self, name: str, byte_off: int, t: torch.Tensor) -> None:
        self.f.seek(self.data_start + self.base[name] + byte_off)
        self.f.write(t.contiguous().view(torch.uint8).numpy().tobytes())

    def put_row(self, r: int, ids: torch.Tensor, mask: torch.Tensor, feats: torch.Tensor, greedy: torch.Tensor):
        t0 = self.tok_off[r]
        self._put("features", t0 * self.feature_dim * self.item, feats.to(self.torch_dtype).cpu())
        self._put("input_ids", t0 * 8, ids.to(torch.int64))
        self._put("loss_mask", t0, mask.to(torch.uint8))
        self._put("greedy_next", t0 * 8, greedy.to(torch.int64).cpu())

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def write_feature_cache(target: str | None, data: str | Path, output: str | Path,
                        target_layer_ids: list[int] | None = None, batch_size: int = 8,
                        rows_per_shard: int = 256, dtype: str = "bfloat16", model=None) -> Path:
    """Compute and store target features for every row of a prepared dataset (resumable).

    `model`: an already loaded target (benchmarks, tests); by default it is loaded from `target`.
    """
    from tqdm import tqdm

    from dflash_train.data.prepare import load_prepared
    from dflash_train.features.extract import num_target_layers
    from dflash_train.features.layer_ids import check_target_layer_ids, default_target_layer_ids
    from dflash_train.features.online import pad_right, target_forward
    from dflash_train.features.target import DEFAULT_TARGET_NAME, load_target, resolve_target

    if dtype not in _DTYPES:
        raise DataError(f"dtype {dtype!r}: choose one of {sorted(_DTYPES)}")
    if batch_size < 1 or rows_per_shard < 1:
        raise DataError("--batch-size and --rows-per-shard must be >= 1")
    out = Path(output)
    # a folder with a manifest is this command's own (resumed, or refused below when its inputs differ);
    # one that says it is complete may be read-only: the write check waits until work is left
    own = (out / MANIFEST_FILE).is_file()
    plan = plan_output(out, "--output", sources=[data, target], own=own, overwrite=None,
                       writable=not (own and _read_manifest(out).get("complete")))
    ds = load_prepared(data)
    target_path = resolve_target(target)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if model is None:
        model, _ = load_target(target_path, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
    device = next(model.parameters()).device
    n_layers = num_target_layers(model)
    layer_ids = [int(t) for t in (target_layer_ids or default_target_layer_ids(n_layers, 5))]
    check_target_layer_ids(layer_ids, n_layers, "--layer-ids")
    hidden = int(model.config.get_text_config().hidden_size)
    lengths_all = [len(x) for x in ds["input_ids"]]
    manifest = {
        "format": FORMAT, "version": 1, "complete": False,
        "target": target or DEFAULT_TARGET_NAME, "target_path": str(target_path),
        "target_revision": target_revision(target_path), "target_layer_ids": layer_ids,
        "aux_hidden_state_layer_ids": [t + 1 for t in layer_ids], "hidden_size": hidden,
        "feature_dim": hidden * len(layer_ids), "dtype": dtype, "num_rows": len(ds),
        "num_tokens": sum(lengths_all), "rows_per_shard": rows_per_shard,
        "data_path": str(Path(data).resolve()), "data_fingerprint": ds._fingerprint, "shards": [],
    }
    manifest["shards"] = _resumable_shards(out, manifest)
    if manifest["complete"]:
        return out
    ensure_folder(plan, "features")
    left = manifest["num_tokens"] - sum(s["tokens"] for s in manifest["shards"])
    check_writable(out, "--output", left * (manifest["feature_dim"] * _DTYPES[dtype][0].itemsize + 17), inside=True)
    for stale in out.glob(".shard-*.tmp"):
        stale.unlink()
    done = {s["file"] for s in manifest["shards"]}
    n_shards = (len(ds) + rows_per_shard - 1) // rows_per_shard
    bar = tqdm(total=manifest["num_tokens"], desc="features", unit="tok", unit_scale=True,
               initial=sum(s["tokens"] for s in manifest["shards"]))
    # one background thread writes rows, finishes shards and updates the manifest, in order,
    # while the next batch runs; at most two batches wait for it (memory stays ~one batch)
    pool, pending = ThreadPoolExecutor(max_workers=1), deque()

    def submit(fn, *a) -> None:
        pending.append(pool.submit(fn, *a))
        while len(pending) > 2:
            pending.popleft().result()

    def put_rows(writer, idx, ids_l, masks, feats, greedy, lengths):
        feats, greedy = feats.cpu(), greedy.cpu()
        for j, r in enumerate(idx):
            n = lengths[r]
            writer.put_row(r, ids_l[j], masks[j], feats[j, :n], greedy[j, :n])

    def finish(writer, tmp, name, lo, hi, tokens):
        writer.close()
        os.replace(tmp, out / name)
        manifest["shards"].append({"file": name, "rows": [lo, hi], "tokens": tokens,
                                   "bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)})
        manifest["complete"] = len(manifest["shards"]) == n_shards
        _write_json(out / MANIFEST_FILE, manifest)

    writer = None
    try:
        for k in range(n_shards):
            name = shard_name(k)
            if name in done:
                continue
            lo, hi = k * rows_per_shard, min(len(ds), (k + 1) * rows_per_shard)
            rows = ds.select(range(lo, hi))
            lengths = lengths_all[lo:hi]
            tmp = out / f".{name}.tmp"
            writer = _ShardWriter(tmp, lengths, list(range(lo, hi)), manifest["feature_dim"], dtype)
            for idx in shard_batches(lengths, batch_size):
                ids_l = [torch.tensor(rows[r]["input_ids"], dtype=torch.long) for r in idx]
                masks = [torch.tensor(rows[r]["loss_mask"], dtype=torch.uint8) for r in idx]
                ids, attn = pad_right(ids_l)
                feats, greedy = target_forward(model, layer_ids, ids.to(device), attn.to(device))
                submit(put_rows, writer, idx, ids_l, masks, feats, greedy, lengths)
                bar.update(sum(lengths[r] for r in idx))
            submit(finish, writer, tmp, name, lo, hi, sum(lengths))
            writer = None
        while pending:
            pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=True)
        if writer is not None and not writer.f.closed:
            writer.f.close()
    bar.close()
    return out


def shard_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Batches of a shard's rows, longest first so each batch pads little."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    return [order[b: b + batch_size] for b in range(0, len(order), batch_size)]


def _resumable_shards(out: Path, manifest: dict) -> list[dict]:
    """Finished shards of an earlier run with the same inputs; raises if the inputs differ."""
    path = out / MANIFEST_FILE
    if not path.is_file():
        return []
    old = _read_manifest(out)
    diff = [k for k in _INPUT_KEYS if old.get(k) != manifest.get(k)]
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


def _read_manifest(path: Path) -> dict:
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


# ---- reading --------------------------------------------------------------------------

class FeatureCache:
    """Read access to a complete cache; `document(i)` is row i of the prepared data."""

    def __init__(self, path: str | Path, target: str | None = None, target_layer_ids: list[int] | None = None):
        self.path = Path(path)
        self.manifest = _read_manifest(self.path)
        m = self.manifest
        if not m.get("complete"):
            raise DataError(f"{self.path}: the feature cache is incomplete ({len(m['shards'])} shards written); "
                            "rerun `dflash-train features` with the same flags to finish it")
        if target is not None:
            from dflash_train.features.target import resolve_target

            rev = target_revision(resolve_target(target))
            if rev != m["target_revision"]:
                raise DataError(f"{self.path}: features were computed for target {m['target']!r} (revision "
                                f"{m['target_revision']}), not for {target!r} (revision {rev}); recompute them "
                                "with `dflash-train features --target ...` or pass the matching target")
        if target_layer_ids is not None and [int(t) for t in target_layer_ids] != m["target_layer_ids"]:
            raise DataError(f"{self.path}: features hold target layers {m['target_layer_ids']}, but "
                            f"{list(target_layer_ids)} were asked for; recompute with --layer-ids or change the config")
        self._starts = [s["rows"][0] for s in m["shards"]]
        self._open: dict[int, tuple] = {}
        self._data = None
        self._data_checked = False

    def __len__(self) -> int:
        return int(self.manifest["num_rows"])

    def _shard(self, k: int):
        if k in self._open:
            return self._open[k]
        from safetensors import safe_open

        s = self.manifest["shards"][k]
        f = self.path / s["file"]
        fix = f"delete {f.name} and rerun `dflash-train features` with the same flags to recompute it"
        if not f.is_file():
            raise DataError(f"{f}: shard listed in the manifest is missing; {fix}")
        if f.stat().st_size != s["bytes"]:
            raise DataError(f"{f}: shard is truncated or corrupt ({f.stat().st_size} bytes, manifest says "
                            f"{s['bytes']}); {fix}")
        try:
            handle = safe_open(str(f), framework="pt")
            offsets = handle.get_tensor("row_offsets")
            row_index = handle.get_tensor("row_index")
            fshape = handle.get_slice("features").get_shape()
            shapes = {k2: handle.get_slice(k2).get_shape() for k2 in ("input_ids", "loss_mask", "greedy_next")}
        except Exception as exc:
            raise DataError(f"{f}: cannot read the shard ({exc}); {fix}") from exc
        lo, hi = s["rows"]
        n = s["tokens"]
        ok = (list(fshape) == [n, self.manifest["feature_dim"]] and all(v == [n] for v in shapes.values())
              and offsets.numel() == hi - lo + 1 and int(offsets[-1]) == n
              and row_index.tolist() == list(range(lo, hi)))
        if not ok:
            raise DataError(f"{f}: shard shapes disagree with the manifest (features {fshape}, "
                            f"{offsets.numel() - 1} rows); {fix}")
        self._open[k] = (handle, offsets.tolist())
        return self._open[k]

    def _prepared(self):
        if not self._data_checked:
            self._data_checked = True
            p = Path(self.manifest.get("data_path", ""))
            if p.is_dir():
                from dflash_train.data.prepare import load_prepared

                ds = load_prepared(p)
                if ds._fingerprint != self.manifest["data_fingerprint"] or len(ds) != len(self):
                    raise DataError(f"{self.path}: the prepared data at {p} changed since the features were "
                                    "computed; rerun `dflash-train features`")
                self._data = ds
        return self._data

    def document(self, i: int) -> Document:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range 0..{len(self) - 1}")
        import bisect

        k = bisect.bisect_right(self._starts, i) - 1
        handle, offsets = self._shard(k)
        r = i - self.manifest["shards"][k]["rows"][0]
        a, b = offsets[r], offsets[r + 1]
        f = self.path / self.manifest["shards"][k]["file"]
        feats = handle.get_slice("features")[a:b]
        ids = handle.get_slice("input_ids")[a:b]
        mask = handle.get_slice("loss_mask")[a:b].bool()
        greedy = handle.get_slice("greedy_next")[a:b]
        if not torch.isfinite(feats).all():
            raise DataError(f"{f}: row {i} has non-finite features; delete the shard and rerun `dflash-train features`")
        data = self._prepared()
        if data is not None:
            row = data[i]
            if row["input_ids"] != ids.tolist() or row["loss_mask"] != mask.int().tolist():
                raise DataError(f"{f}: row {i} holds other tokens than the prepared data at "
                                f"{self.manifest['data_path']}; rerun `dflash-train features`")
        return Document(input_ids=ids, loss_mask=mask, features=feats, greedy_next=greedy)

    def lengths(self) -> list[int]:
        out = []
        for k in range(len(self.manifest["shards"])):
            offsets = self._shard(k)[1]
            out += [offsets[r + 1] - offsets[r] for r in range(len(offsets) - 1)]
        return out

    def verify(self) -> None:
        """Check every shard's sha256 against the manifest (reads every byte)."""
        for s in self.manifest["shards"]:
            f = self.path / s["file"]
            if not f.is_file() or sha256_file(f) != s["sha256"]:
                raise DataError(f"{f}: checksum mismatch; delete it and rerun `dflash-train features`")
