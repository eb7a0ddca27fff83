"""Offline feature cache: sharded safetensors plus a manifest.

Layout of a cache folder:
- `shard-NNNNN.safetensors`, each holding a run of consecutive rows, concatenated over tokens:
  `features` [N, n*H] (bfloat16 by default), `input_ids` [N] int64, `loss_mask` [N] uint8,
  `greedy_next` [N] int64 (the target's argmax at each position), `row_offsets` [R+1] int64
  (row r is tokens row_offsets[r]:row_offsets[r+1]) and `row_index` [R] int64 (dataset rows);
  written with `topk=k` (the kl loss), also `target_topk_ids` [N, k] int32 and `target_topk_logp`
  [N, k] bfloat16: the target's k most likely next tokens at each position (over the whole vocabulary, or
  over the ids `topk_vocab` names: a drafter's reduced vocabulary), largest first.
- `manifest.json`: target name, path and revision, layer ids, dtype, row and token counts, the
  prepared data's path and fingerprint, and one entry per finished shard (rows, tokens, bytes,
  sha256), plus `complete`, `topk` (0: no top-k) and `greedy_next` (false: written with
  `greedy=False`, for `objective.labels: dataset`: the forward stopped after the deepest layer
  needed, no LM head, and the `greedy_next` column holds -1; "prompts": written with `greedy="prompts"`,
  for dataset labels on the answers and the prompts' positions trained too: the argmax only where the
  next token is outside the loss mask, -1 where it is an answer's token).

Writing: a shard's layout is known before the forward passes (row lengths come from the prepared
data), so its header is written first and each batch's rows are written at their offsets. Rows are
batched longest first within a shard: at most --batch-size rows (default 8 on CPU, no row limit on
CUDA) and, on CUDA, at most `batch_tokens` padded tokens (default: `batch_tokens_that_fit`). Writer
threads (`cache_writer.py`) write the batches while the next forward runs, behind a bounded queue.
A shard is written under a temp name and renamed when whole; the manifest is rewritten atomically
after each shard. A rerun with the same inputs after a crash or SIGKILL keeps the finished shards
(checksums verified) and computes the rest.

Size on disk per token: feature_dim * dtype bytes + 17 (input id, greedy next id, mask byte) + 6 * k
(top-k): 5.78 GB per 1M tokens for SmolLM2-135M (5 layers x 576, bf16), 40.98 GB for Qwen3-8B (5 x 4096).

Finiteness is checked once, as a row is written (in the writer thread): a non-finite feature stops
the write naming the row; a finished shard's manifest entry carries `"finite": true` (a shard without
it has its rows checked as read). Reading validates each shard when first opened (header checks:
shapes, dtype, offsets; ids and masks against the prepared data when still there), never per row.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Literal

import torch

from dflash_train.data.packing import Document
from dflash_train.errors import DataError
from dflash_train.features.cache_writer import DTYPES as _DTYPES
from dflash_train.features.cache_writer import FORMAT, BackgroundWriter, ShardWriter, shard_batches, to_host
from dflash_train.features.manifest import (
    MANIFEST_FILE,
    read_manifest,
    resumable_shards,
    sha256_file,
    target_revision,
    write_json,
)
from dflash_train.outputs import check_writable, ensure_folder, plan_output

BATCH_TOKENS_CUDA = 65536  # more tokens per forward gain little on one GPU; the queue holds a few batches
IO_THREADS_CUDA = 4
SAFETY = 0.6
TOPK_KEYS = ("target_topk_ids", "target_topk_logp")
NO_GREEDY = -1  # the greedy_next column of a cache written without the LM head


def serves_greedy(held: bool | str, greedy: bool | str) -> bool:
    """Whether a cache whose manifest's `greedy_next` reads `held` gives a reader asking for `greedy` its greedy
    tokens: every position's (True) serves every reader, the prompts' alone ("prompts") those asking for them."""
    return not greedy or held is True or (greedy == "prompts" and held == "prompts")


def outside_answers(masks: list[torch.Tensor], width: int) -> torch.Tensor:
    """[B, width] bool: the positions of right-padded rows whose next token is outside the loss mask (the
    template's and the prompts' tokens), where `greedy="prompts"` needs the target's argmax. A position whose
    next token is an answer's is labelled with that token, and the last one has no next token."""
    out = torch.zeros(len(masks), width, dtype=torch.bool)
    for j, m in enumerate(masks):
        out[j, : m.numel() - 1] = ~m[1:].bool()
    return out


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


# ---- writing --------------------------------------------------------------------------

def bytes_per_token(feature_dim: int, dtype: str = "bfloat16", topk: int = 0) -> int:
    """Bytes a cache takes per token: features, input id and greedy next id (int64), mask (uint8), and
    with top-k its int32 ids and bf16 log-probs."""
    return feature_dim * torch.empty((), dtype=_DTYPES[dtype][0]).element_size() + 17 + 6 * topk


def batch_tokens_that_fit(config, n_features: int, free_bytes: int, dtype_bytes: int = 2) -> int:
    """Padded tokens per forward on a GPU: SAFETY * free memory over the bytes one token needs there
    (one layer's activations 3 * intermediate + 6 * hidden, the captured layers three times: outputs,
    concatenation, stored copy, and one row of LM-head logits), at most BATCH_TOKENS_CUDA."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    inter = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    per_token = (3 * inter + 6 * hidden + 3 * n_features * hidden + int(text.vocab_size)) * dtype_bytes
    return max(1, min(BATCH_TOKENS_CUDA, int(SAFETY * free_bytes // per_token)))


def write_feature_cache(target: str | None, data: str | Path, output: str | Path,
                        target_layer_ids: list[int] | None = None, batch_size: int | None = None,
                        rows_per_shard: int = 256, dtype: str = "bfloat16", model=None,
                        batch_tokens: int | None = None, io_threads: int | None = None,
                        stats: dict | None = None, topk: int | None = None, target_dtype: str | None = None,
                        greedy: bool | Literal["prompts"] = True, topk_vocab: torch.Tensor | None = None) -> Path:
    """Compute and store target features for every row of a prepared dataset (resumable).

    `model`: an already loaded target (benchmarks, tests); by default it is loaded from `target`.
    `batch_size` rows / `batch_tokens` padded tokens per forward and `io_threads` writer threads
    default to 8 / unlimited / 1 on CPU and unlimited / `batch_tokens_that_fit` / 4 on CUDA.
    `stats`, when given, receives the tokens computed, seconds, and seconds the forward waited on the writers.
    `topk`: also store the target's top-k next-token ids and log-probs (for `objective.loss: kl`); over the
    sorted target ids `topk_vocab` only when given (a drafter's reduced vocabulary: `objective.kl_teacher`).
    `target_dtype`: what the target computes in (float32, bfloat16; default bfloat16 on CUDA, float32 on
    CPU); `dtype` is what the features are stored in.
    `greedy=False`: no greedy next tokens (`objective.labels: dataset` never reads them), so the target's
    forward stops after the deepest layer asked for and its LM head never runs (~1.2x faster for SmolLM2).
    `greedy="prompts"` (`objective.labels: dataset` with `objective.positions: all`): the greedy next token only
    where the next token is not an answer's (the dataset's token is the label there), so the whole head runs on
    the prompts' positions alone; with a top k over the whole vocabulary every position's argmax comes free.
    """
    from tqdm import tqdm

    from dflash_train.data.prepare import load_prepared
    from dflash_train.features.extract import num_target_layers, vocab_tag
    from dflash_train.features.layer_ids import check_target_layer_ids, default_target_layer_ids
    from dflash_train.features.online import pad_right, target_forward
    from dflash_train.target import (
        DEFAULT_TARGET_NAME,
        dtype_name,
        load_target,
        resolve_target,
        target_torch_dtype,
    )

    if dtype not in _DTYPES:
        raise DataError(f"dtype {dtype!r}: choose one of {sorted(_DTYPES)}")
    if any(v is not None and v < 1 for v in (batch_size, batch_tokens, io_threads, topk)) or rows_per_shard < 1:
        raise DataError("--batch-size, --batch-tokens, --io-threads, --topk and --rows-per-shard must be >= 1")
    topk = int(topk or 0)
    out = Path(output)
    # a folder with a manifest is this command's own (resumed, or refused below when its inputs differ);
    # one that says it is complete may be read-only: the write check waits until work is left
    own = (out / MANIFEST_FILE).is_file()
    plan = plan_output(out, "--output", sources=[data, target], own=own, overwrite=None,
                       writable=not (own and read_manifest(out).get("complete")))
    ds = load_prepared(data)
    target_path = resolve_target(target)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if model is None:
        model, _ = load_target(target_path, dtype=target_torch_dtype(target_dtype, device), device=device)
    device = next(model.parameters()).device
    compute = dtype_name(next(model.parameters()).dtype)
    n_layers = num_target_layers(model)
    layer_ids = [int(t) for t in (target_layer_ids or default_target_layer_ids(n_layers, 5))]
    check_target_layer_ids(layer_ids, n_layers, "--layer-ids")
    hidden = int(model.config.get_text_config().hidden_size)
    cuda = device.type == "cuda"
    if cuda and batch_tokens is None:
        batch_tokens = batch_tokens_that_fit(model.config, len(layer_ids), torch.cuda.mem_get_info(device)[0],
                                             next(model.parameters()).element_size())
    if not cuda and batch_size is None:
        batch_size = 8
    lengths_all = [len(x) for x in ds["input_ids"]]
    manifest = {
        "format": FORMAT, "version": 1, "complete": False,
        "target": target or DEFAULT_TARGET_NAME, "target_path": str(target_path),
        "target_revision": target_revision(target_path), "target_layer_ids": layer_ids,
        "aux_hidden_state_layer_ids": [t + 1 for t in layer_ids], "hidden_size": hidden,
        "feature_dim": hidden * len(layer_ids), "dtype": dtype, "num_rows": len(ds),
        "num_tokens": sum(lengths_all), "rows_per_shard": rows_per_shard,
        "data_path": str(Path(data).resolve()), "data_fingerprint": ds._fingerprint, "topk": topk,
        "target_dtype": compute, "shards": [],
        "greedy_next": True if greedy is True or (topk and topk_vocab is None) else greedy or False,
        "topk_vocab": vocab_tag(topk_vocab) if topk and topk_vocab is not None else None,
    }
    manifest["shards"] = resumable_shards(out, manifest)
    if manifest["complete"]:
        return out
    left = manifest["num_tokens"] - sum(s["tokens"] for s in manifest["shards"])  # room checked before the folder
    check_writable(out, "--output", left * bytes_per_token(manifest["feature_dim"], dtype, topk), inside=out.is_dir())
    ensure_folder(plan, "features")
    for stale in out.glob(".shard-*.tmp"):
        stale.unlink()
    done = {s["file"] for s in manifest["shards"]}
    n_shards = (len(ds) + rows_per_shard - 1) // rows_per_shard
    bar = tqdm(total=manifest["num_tokens"], desc="features", unit="tok", unit_scale=True,
               initial=sum(s["tokens"] for s in manifest["shards"]))
    threads = io_threads or (IO_THREADS_CUDA if cuda else 1)
    pool = BackgroundWriter(threads=threads, max_pending=threads + 1)
    manifest_lock = threading.Lock()
    copy_stream = torch.cuda.Stream(device) if cuda else None
    storage = _DTYPES[dtype][0]

    def write_batch(shard, idx, ids_l, masks, host, event, lengths, name, lo, hi):  # in a writer thread
        if event is not None:
            event.synchronize()
        feats, greedy, *top = host
        for j, r in enumerate(idx):
            n = lengths[r]
            if not torch.isfinite(feats[j, :n]).all():  # once, here: readers trust the shard's stamp
                raise DataError(f"{out}: the target produced non-finite features for row {r} of {data}; the "
                                "target's weights or its compute dtype overflow: compute in float32 "
                                "(`--target-dtype float32`, data.target_dtype), or drop the row")
            shard.put_row(r, ids_l[j], masks[j], feats[j, :n], greedy[j, :n], *(t[j, :n] for t in top))
        if shard.done_one():
            finish(shard, name, lo, hi)

    def finish(shard, name, lo, hi):  # in a writer thread, once per shard
        shard.close()
        os.replace(shard.path, out / name)
        entry = {"file": name, "rows": [lo, hi], "tokens": shard.tokens, "bytes": (out / name).stat().st_size,
                 "sha256": sha256_file(out / name), "finite": True}  # every row checked in write_batch
        with manifest_lock:
            manifest["shards"] = sorted(manifest["shards"] + [entry], key=lambda s: s["file"])
            manifest["complete"] = len(manifest["shards"]) == n_shards
            write_json(out / MANIFEST_FILE, manifest)

    shards, computed, start = [], 0, time.perf_counter()
    try:
        for k in range(n_shards):
            name = shard_name(k)
            if name in done:
                continue
            lo, hi = k * rows_per_shard, min(len(ds), (k + 1) * rows_per_shard)
            rows = ds.select(range(lo, hi))
            lengths = lengths_all[lo:hi]
            shard = ShardWriter(out / f".{name}.tmp", lengths, list(range(lo, hi)), manifest["feature_dim"], dtype, topk)
            shards.append(shard)
            for idx in shard_batches(lengths, batch_size, batch_tokens):
                ids_l = [torch.tensor(rows[r]["input_ids"], dtype=torch.long) for r in idx]
                masks = [torch.tensor(rows[r]["loss_mask"], dtype=torch.uint8) for r in idx]
                ids, attn = pad_right(ids_l)
                wanted = outside_answers(masks, ids.shape[1]).to(device) if greedy == "prompts" else greedy
                feats, next_ids, *top = target_forward(model, layer_ids, ids.to(device), attn.to(device), topk or None,
                                                       greedy=wanted, topk_vocab=topk_vocab if topk else None)
                if next_ids is None:
                    next_ids = torch.full(ids.shape, NO_GREEDY, dtype=torch.long, device=feats.device)
                top = [top[0], top[1].to(torch.bfloat16)] if top else []
                host, event = to_host([feats.to(storage) if cuda else feats, next_ids, *top], copy_stream)
                shard.add_pending()
                pool.submit(write_batch, shard, idx, ids_l, masks, host, event, lengths, name, lo, hi)
                bar.update(sum(lengths[r] for r in idx))
                computed += sum(lengths[r] for r in idx)
            if shard.seal():
                pool.submit(finish, shard, name, lo, hi)
        pool.close()
    except BaseException:
        pool.abort()
        raise
    finally:
        for shard in shards:
            shard.abandon()  # only those a failure left open
        bar.close()
    if stats is not None:
        stats.update(tokens=computed, seconds=time.perf_counter() - start, waited_s=pool.waited_s)
    return out


# ---- reading --------------------------------------------------------------------------

class FeatureCache:
    """Read access to a complete cache; `document(i)` is row i of the prepared data."""

    def __init__(self, path: str | Path, target: str | None = None, target_layer_ids: list[int] | None = None,
                 topk: int | None = None, target_dtype: str | None = None, greedy: bool | str = False,
                 topk_vocab: str | None = None):
        """The arguments, when given, are what the reader needs; a cache that does not hold it is refused.
        `greedy`: the target's greedy next tokens (`objective.labels: greedy`), or "prompts": at least where the
        next token is outside the loss mask (dataset labels with the prompts' positions); `topk_vocab`: with `topk`, the
        `vocab_tag` of the ids the top k must be taken over (None: the whole vocabulary)."""
        self.path = Path(path)
        self.manifest = {"topk": 0, "greedy_next": True, **read_manifest(self.path)}
        m = self.manifest
        if not m.get("complete"):
            raise DataError(f"{self.path}: the feature cache is incomplete ({len(m['shards'])} shards written); "
                            "rerun `dflash-train features` with the same flags to finish it")
        if target is not None:
            from dflash_train.target import resolve_target

            rev = target_revision(resolve_target(target))
            if rev != m["target_revision"]:
                raise DataError(f"{self.path}: features were computed for target {m['target']!r} (revision "
                                f"{m['target_revision']}), not for {target!r} (revision {rev}); recompute them "
                                "with `dflash-train features --target ...` or pass the matching target")
        if target_layer_ids is not None and [int(t) for t in target_layer_ids] != m["target_layer_ids"]:
            raise DataError(f"{self.path}: features hold target layers {m['target_layer_ids']}, but "
                            f"{list(target_layer_ids)} were asked for; recompute with --layer-ids or change the config")
        if topk and m["topk"] < topk:
            raise DataError(f"{self.path}: the feature cache holds {m['topk'] or 'no'} top-k target log-probs per "
                            f"token, but objective.loss: kl with kl_topk {topk} needs {topk}; rebuild it with "
                            f"`dflash-train features --topk {topk}` into a new folder (or lower objective.kl_topk)")
        if topk and m.get("topk_vocab") != topk_vocab:
            def over(tag): return f"ids {tag}" if tag else "the whole vocabulary"
            raise DataError(f"{self.path}: the cache's top-k is over {over(m.get('topk_vocab'))}, but objective."
                            f"kl_teacher asks for one over {over(topk_vocab)}; point data.feature_cache at another "
                            "folder, or leave it unset (each teacher gets its own)")
        if target_dtype and m.get("target_dtype", target_dtype) != target_dtype:
            raise DataError(f"{self.path}: features were computed by the target in {m['target_dtype']}, but "
                            f"data.target_dtype asks for {target_dtype}; set data.target_dtype: {m['target_dtype']} "
                            "or point data.feature_cache at another folder")
        if not serves_greedy(m["greedy_next"], greedy):
            held = ("only at the prompts' positions (written for dataset labels with objective.positions: all)"
                    if m["greedy_next"] == "prompts" else "nowhere (written for objective.labels: dataset)")
            need = ("objective.positions: all needs them at the prompts' positions" if greedy == "prompts"
                    else "objective.labels: greedy needs them at every position")
            raise DataError(f"{self.path}: the feature cache holds the target's greedy next tokens {held}; {need}. "
                            "Point data.feature_cache at a cache written with them, or leave it unset (each "
                            "labelling gets a folder of its own)")
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
            top = {k2: handle.get_slice(k2).get_shape() for k2 in TOPK_KEYS if self.manifest["topk"]}
        except Exception as exc:
            raise DataError(f"{f}: cannot read the shard ({exc}); {fix}") from exc
        lo, hi = s["rows"]
        n = s["tokens"]
        ok = (list(fshape) == [n, self.manifest["feature_dim"]] and all(v == [n] for v in shapes.values())
              and all(v == [n, self.manifest["topk"]] for v in top.values())
              and offsets.numel() == hi - lo + 1 and int(offsets[-1]) == n
              and row_index.tolist() == list(range(lo, hi)))
        if not ok:
            raise DataError(f"{f}: shard shapes disagree with the manifest (features {fshape}, "
                            f"{offsets.numel() - 1} rows); {fix}")
        self._check_against_prepared(handle, offsets, lo, hi, f)
        self._open[k] = (handle, offsets.tolist(), bool(s.get("finite")))
        return self._open[k]

    def _check_against_prepared(self, handle, offsets: torch.Tensor, lo: int, hi: int, f: Path) -> None:
        """The shard's ids and masks equal the prepared rows lo..hi (when that data is still there): one
        comparison when the shard is opened, instead of one per row read."""
        data = self._prepared()
        if data is None:
            return
        rows = data.select(range(lo, hi))
        ids, masks = handle.get_tensor("input_ids"), handle.get_tensor("loss_mask")
        for r, (want_ids, want_mask) in enumerate(zip(rows["input_ids"], rows["loss_mask"], strict=True)):
            a, b = int(offsets[r]), int(offsets[r + 1])
            if ids[a:b].tolist() != want_ids or masks[a:b].tolist() != [int(x) for x in want_mask]:
                raise DataError(f"{f}: row {lo + r} holds other tokens than the prepared data at "
                                f"{self.manifest['data_path']}; rerun `dflash-train features`")

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
        handle, offsets, stamped = self._shard(k)
        r = i - self.manifest["shards"][k]["rows"][0]
        a, b = offsets[r], offsets[r + 1]
        feats = handle.get_slice("features")[a:b]
        ids = handle.get_slice("input_ids")[a:b]
        mask = handle.get_slice("loss_mask")[a:b].bool()
        greedy = handle.get_slice("greedy_next")[a:b]
        if not stamped and not torch.isfinite(feats).all():  # a shard from before the write-time check
            f = self.path / self.manifest["shards"][k]["file"]
            raise DataError(f"{f}: row {i} has non-finite features; delete the shard and rerun `dflash-train features`")
        top = [handle.get_slice(k2)[a:b] for k2 in TOPK_KEYS] if self.manifest["topk"] else [None, None]
        return Document(input_ids=ids, loss_mask=mask, features=feats, greedy_next=greedy, target_topk_ids=top[0],
                        target_topk_logp=top[1])

    def lengths(self) -> list[int]:
        """Every row's token count; opening each shard checks it (a damaged one is refused here)."""
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
