"""The recipe's data section as training documents.

1. Prepared rows: an existing folder (`data.prepared`), or the data stage's prepare (and
   regenerate) run once and cached under `$DFLASH_CACHE/data/<key>/`.
2. A deterministic held-out split of those rows (`data.holdout_fraction`, seeded by `data.seed`,
   not by the run's `seed`: runs of several seeds are measured on the same rows); the rows a periodic
   check reads are taken round-robin over a mixture's sources, so every source counts.
3. Documents with context features and greedy tokens: `online` (target forward every time, a
   micro-batch's documents in groups of similar lengths, `padded_groups`),
   `memory` (computed once per row, kept in RAM) or `offline` (the data stage's feature cache, which
   `feature_source.py` picks for a recipe).
   The target runs under inference_mode; online features, greedy tokens and top-k stay on the
   target's device (a GPU run never copies them to the host and back).
4. For the kl loss (`topk=k`), each document also carries the target's top-k next-token ids and
   log-probabilities from the same forward: int32 ids and bf16 log-probs in memory mode (k=32:
   192 bytes per token next to 5,760 of SmolLM2 features), the cache's shards offline. With
   `topk_vocab` (`objective.kl_teacher: draft_vocab`) the top k are taken over the drafter's reduced
   vocabulary only, from the target head's rows of those ids; an offline cache of its own holds them.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash_train.data.packing import EXTRA_CALL_SHARE, Document, padded_groups
from dflash_train.errors import DataError
from dflash_train.train.anchors import shared_prefix_length
from dflash_train.train.recipe import DataConfig

if TYPE_CHECKING:
    from datasets import Dataset


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _sampling_seed(data: DataConfig) -> dict:
    """What data.seed adds to a cache key: nothing for greedy answers (the seed cannot change them) nor for the
    default seed (keys written before data.seed existed stay valid), else the seed."""
    r = data.regenerate
    return {"seed": data.seed} if r.enabled and r.temperature > 0 and data.seed != 0 else {}


def data_cache_root(data: DataConfig, target_path: str) -> Path:
    ident = {"target": target_path, **data.model_dump(mode="json", exclude={"features", "holdout_fraction", "seed",
                                                                             "cache_dir", "feature_cache",
                                                                             "train_fraction", "target_dtype"}),
             "regenerate": data.regenerate.cache_inputs(), **_sampling_seed(data)}
    return _cache_base(data) / _key(ident)


def prepared_rows(data: DataConfig, target_path: str) -> Path:
    """The folder of prepared (and possibly regenerated) rows, building and caching it if needed.

    A mixture (`data.source` a list) prepares and regenerates each source on its own, cached under
    a key of that source's settings alone (so another mixture, or another count of one source,
    reuses the others' regenerated rows), then concatenates them with a `source` label per row.
    The data stage is seeded by `data.seed`."""
    seed = data.seed
    if data.prepared:
        path = Path(data.prepared)
        if not path.exists():
            raise DataError(f"data.prepared: {path} does not exist; run `dflash-train prepare` or set data.source")
        return path
    if not isinstance(data.source, list):
        return _source_rows(data, target_path, seed, data.source, data.max_samples, data.split, data.subset, None,
                            data_cache_root(data, target_path))
    from dflash_train.data.prepare import combine_prepared
    from dflash_train.data.regenerate import Generators
    from dflash_train.train.recipe import source_label

    parts = []
    with Generators(_cache_base(data) / "sources") as generators:  # one engine start for all the sources
        for spec in data.source:
            max_samples, label = spec.max_samples or data.max_samples, source_label(spec)
            ident = {"target": target_path, "source": spec.source, "max_samples": max_samples, "split": spec.split,
                     "subset": spec.subset, "label": label, "max_length": data.max_length,
                     "max_turns": data.max_turns, "regenerate": data.regenerate.cache_inputs(), **_sampling_seed(data)}
            parts.append(_source_rows(data, target_path, seed, spec.source, max_samples, spec.split, spec.subset,
                                      label, _cache_base(data) / "sources" / _key(ident), generators))
    mixed = data_cache_root(data, target_path) / "mixed"
    inputs = {"command": "combine", "target": target_path,
              "parts": [{"path": str(p), "fingerprint": load_rows(p)._fingerprint} for p in parts]}
    from dflash_train.output_lock import output_lock

    with output_lock(mixed, "the data cache", "train", wait=True):
        combine_prepared(parts, mixed, inputs)
    return mixed


def _cache_base(data: DataConfig) -> Path:
    from dflash_train.target import cache_dir

    return Path(data.cache_dir) if data.cache_dir else cache_dir() / "data"


def _source_rows(data: DataConfig, target_path: str, seed: int, source: str, max_samples: int | None,
                 split: str | None, subset: str | None, label: str | None, root: Path,
                 generators=None) -> Path:
    """One source prepared (and regenerated) under `root`, with engines from `generators` when given."""
    from dflash_train.output_lock import output_lock

    # two runs sharing the cache build an entry once: the second waits, then finds it complete
    with output_lock(root, "the data cache", "train", wait=True):
        return _build_source_rows(data, target_path, seed, source, max_samples, split, subset, label, root,
                                  generators)


def _build_source_rows(data: DataConfig, target_path: str, seed: int, source: str, max_samples: int | None,
                       split: str | None, subset: str | None, label: str | None, root: Path, generators) -> Path:
    from dflash_train.data.prepare import prepare_dataset

    prepared = root / "prepared"
    # the cache's folders are the toolkit's own: a stale one (its source file changed) is replaced
    prepare_dataset(target_path, source, prepared, max_samples=max_samples, max_length=data.max_length,
                    split=split, subset=subset, max_turns=data.max_turns, overwrite=True, label=label)
    if not data.regenerate.enabled:
        return prepared
    from dflash_train.data.regenerate import regenerate_dataset

    regen = root / "regenerated"
    r = data.regenerate
    regenerate_dataset(target_path, prepared, regen, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                       thinking=r.thinking, engine=r.engine, batch_size=r.batch_size, seed=seed, dtype=r.dtype,
                       overwrite=True, generators=generators)
    return regen


def load_rows(path: Path):
    from dflash_train.data.prepare import load_prepared

    return load_prepared(path)


def holdout_split(num_rows: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train rows, held-out rows): a fixed random fraction of rows, sorted; seeded, so reproducible."""
    k = 0 if fraction <= 0 else max(1, int(round(num_rows * fraction)))
    if num_rows - k < 1:
        raise DataError(f"data.holdout_fraction {fraction} leaves no training rows out of {num_rows}")
    held = sorted(random.Random(f"holdout-{seed}").sample(range(num_rows), k))
    held_set = set(held)
    return [i for i in range(num_rows) if i not in held_set], held


@dataclass
class TrainingRows:
    """The prepared rows (`path`), the ones a run trains on (the held-out split removed, then
    `data.train_fraction`), the held-out ones, and each row's source label (None: no `source` column)."""
    path: Path
    rows: Dataset
    train: list[int]
    held: list[int]
    labels: list[str] | None

    def token_counts(self):
        """The training rows' token frequencies (held-out answers must not pick the draft vocabulary)."""
        from dflash_train.data.vocab import read_token_freq, training_token_frequencies

        return training_token_frequencies(self.rows, self.train, read_token_freq(self.path))


def training_rows(data: DataConfig, data_path: Path) -> TrainingRows:
    rows = load_rows(data_path)
    train, held = holdout_split(len(rows), data.holdout_fraction, data.seed)
    labels = list(rows["source"]) if "source" in rows.column_names else None
    return TrainingRows(data_path, rows, fraction_of_rows(train, data.train_fraction, data.seed, labels), held, labels)


def interleave_by_label(rows: list[int], labels: list[str]) -> list[int]:
    """Rows taken round-robin over their labels (each label's rows in their order), so the first N
    held-out rows of a mixture cover every source about equally."""
    groups: dict[str, list[int]] = {}
    for row, label in zip(rows, labels, strict=True):
        groups.setdefault(label, []).append(row)
    queues = [groups[k] for k in sorted(groups)]
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def validation_rows(held: list[int], labels: list[str] | None, count: int) -> list[int]:
    """The `count` held-out rows the periodic check reads. Held-out ids are sorted and a mixture's
    rows are stored source by source, so the first ids alone would all be the first source's."""
    order = interleave_by_label(held, [labels[i] for i in held]) if labels else list(held)
    return order[:count]


def source_balance(rows: list[int], labels: list[str] | None) -> dict[int, float] | None:
    """Per training row of a mixture, rows / (sources x rows of its source): what makes the step's acceptance
    length weigh the sources as the check does, whose rows take the sources in turn (`validation_rows`,
    `fit_rows`): every source by as many rows, each row by its positions. None without a mixture."""
    if not labels:
        return None
    counts: dict[str, int] = {}
    for i in rows:
        counts[labels[i]] = counts.get(labels[i], 0) + 1
    return {i: len(rows) / (len(counts) * counts[labels[i]]) for i in rows}


def fit_rows(train_rows: list[int], labels: list[str] | None, count: int, seed: int) -> list[int]:
    """`count` training rows for the check's like-for-like training numbers: a seeded random draw,
    the sources taking turns as in `validation_rows`."""
    order = random.Random(f"fit-{seed}").sample(train_rows, len(train_rows))
    return (interleave_by_label(order, [labels[i] for i in order]) if labels else order)[:count]


def fraction_of_rows(rows: list[int], fraction: float, seed: int, labels: list[str] | None = None) -> list[int]:
    """A seeded `fraction` of `rows`, sorted: the same share of each label's rows when labelled, and
    nested (a smaller fraction's rows are inside a larger one's), so data-size curves compare like with like."""
    if fraction >= 1:
        return list(rows)
    groups: dict[str, list[int]] = {}
    for i in rows:
        groups.setdefault(labels[i] if labels else "", []).append(i)
    keep = []
    for label, members in sorted(groups.items()):
        order = random.Random(f"fraction-{seed}-{label}").sample(members, len(members))
        keep += order[:max(1, round(len(members) * fraction))]
    return sorted(keep)


MEMORY_SHARE = 0.4  # of a GPU's free memory that memory-mode documents may take; the steps need the rest


def memory_home(device: torch.device, needed_bytes: int, free_bytes: int | None,
                share: float = MEMORY_SHARE) -> torch.device:
    """Where memory mode keeps its documents: on the target's GPU when they take at most `share` of its
    free memory (a step then reads them there: no host copy, no pinned bounce), else in host RAM."""
    if device.type == "cpu" or free_bytes is None or needed_bytes > share * free_bytes:
        return torch.device("cpu")
    return device


def launch_tokens(device_type: str, layers: int, parameters: int, experts: int = 1) -> float:
    """The target tokens one more eager forward's kernel launches are worth (estimates, unmeasured): on a GPU
    ~0.25 ms of launches a decoder layer whatever the batch, against ~2 x parameters FLOPs a token at ~400
    TFLOP/s. Qwen3-8B ~220 tokens (splitting a micro-batch pays); SmolLM2-135M ~11,000 (it seldom does). A
    mixture of `experts` launches kernels for each expert its tokens reach, so on a GPU a forward more may cost
    about what the whole micro-batch does: never split (inf). A CPU forward costs its arithmetic: 0."""
    if device_type != "cuda":
        return 0.0
    if experts > 1:
        return float("inf")
    return layers * 0.25e-3 * 400e12 / (2 * parameters)


class DocumentSource:
    """Documents (features + greedy tokens) for prepared rows, with the target's top-k next-token
    log-probs when `topk` is set (the kl loss; over the sorted target ids `topk_vocab` only when given)."""

    def __init__(self, rows, mode: str, target_model=None, target_layer_ids=None, feature_cache=None,
                 topk: int | None = None, target_hidden: int | None = None, topk_vocab: torch.Tensor | None = None):
        self.rows = rows
        self.mode = mode
        self.topk = topk
        self.topk_vocab = topk_vocab
        self.lengths = [len(x) for x in rows["input_ids"]]
        self.cache = feature_cache
        self.layer_ids = list(target_layer_ids)
        self.expected_dim = None if target_hidden is None else len(self.layer_ids) * target_hidden
        self._memory: dict[int, Document] = {}
        self._lock = threading.Lock()
        self._extract = None
        self._prompt_start: int | None = None
        self.home = torch.device("cpu")  # memory mode's store; `warm` moves it to the GPU when the rows fit there
        self.extra_call_tokens: float | None = None  # `padded_groups`' price of a forward (inf: one per call)
        self._launch_tokens = 0.0  # what one more forward's launches cost, in the target's tokens
        self.forwards: Counter = Counter()  # the target's forwards so far: their count, padded positions and tokens
        if mode in ("online", "memory"):
            from dflash_train.features.extract import TargetFeatures

            self._extract = TargetFeatures(target_model, self.layer_ids)
            text = target_model.config.get_text_config()
            experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 1
            self._launch_tokens = launch_tokens(next(target_model.parameters()).device.type, self._extract.num_layers,
                                                sum(p.numel() for p in target_model.parameters()), experts)

    def __len__(self) -> int:
        return len(self.lengths)

    def prompt_start(self) -> int:
        """The first position after the template prefix all rows share (`objective.positions: all`)."""
        if self._prompt_start is None:
            self._prompt_start = shared_prefix_length(list(self.rows["input_ids"]))
        return self._prompt_start

    def get(self, idx: list[int]) -> list[Document]:
        """Documents of rows `idx`. One caller at a time (the loop and its prefetch thread): the target's
        forward and the memory store are not shared between two at once."""
        with self._lock:
            return self._get(idx)

    def _get(self, idx: list[int]) -> list[Document]:
        if self.mode == "offline":
            return [self._check(self.cache.document(i), i) for i in idx]
        todo = [i for i in idx if i not in self._memory]
        computed = self._compute(todo) if todo else {}
        if self.mode == "memory":
            self._memory.update(computed)
        return [self._memory.get(i) or computed[i] for i in idx]

    def release_target(self) -> None:
        """Drop this source's hold on the target: offline mode reads the cache, and memory mode, once `warm` has
        stored every row the run reads, computes nothing more. The caller drops its own reference too, and the
        target's layers are freed (an 8B target's ~15 GB on its GPU) for the steps."""
        if self.mode == "online":
            raise RuntimeError("data.features: online runs the target every step: it cannot be released")
        self._extract = None

    def bytes_per_token(self) -> int:
        """Memory mode's store per token: bf16 features, int64 greedy tokens, int32 + bf16 top-k."""
        width = self.expected_dim or len(self.layer_ids) * self._extract.model.config.get_text_config().hidden_size
        return 2 * width + 8 + (6 * self.topk if self.topk else 0)

    def warm(self, idx: list[int], tokens_per_batch: int = 4096, progress: bool = True) -> torch.device | None:
        """Memory mode: compute the features of rows `idx` now, in batches of similar lengths
        (longest first, so padding is small and a too-large batch fails at once), with a progress
        bar, instead of lazily inside the first epoch's steps. On a GPU they stay there when they fit
        (`memory_home`): every later epoch then costs no target forward and no host copy. Returns
        where they are kept (None outside memory mode)."""
        if self.mode != "memory":
            return None
        from tqdm import tqdm

        todo = sorted({i for i in idx if i not in self._memory}, key=lambda i: (-self.lengths[i], i))
        if not self._memory:  # decided once, before the first row is stored
            device = next(self._extract.model.parameters()).device
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
            self.home = memory_home(device, sum(self.lengths[i] for i in todo) * self.bytes_per_token(), free)
        with tqdm(total=len(todo), desc=f"target features ({self.home.type})", unit="row",
                  disable=not progress) as bar:
            b = 0
            while b < len(todo):
                n = max(1, tokens_per_batch // max(1, self.lengths[todo[b]]))
                batch = todo[b:b + n]
                self._memory.update(self._compute(batch))
                bar.update(len(batch))
                b += len(batch)
        return self.home

    def _check(self, doc: Document, i: int) -> Document:
        if self.expected_dim is not None and doc.features.shape[-1] != self.expected_dim:
            raise DataError(f"feature cache row {i}: features have width {doc.features.shape[-1]} but this "
                            f"target and layer ids need {self.expected_dim}; the cache was written for another "
                            "target or other layer ids: rebuild it or drop data.feature_cache")
        if self.topk and doc.target_topk_ids is not None:  # a cache with a larger k: its first k (sorted)
            doc.target_topk_ids = doc.target_topk_ids[:, : self.topk]
            doc.target_topk_logp = doc.target_topk_logp[:, : self.topk]
        elif not self.topk:  # a kl run's cache read by a run without a teacher: nothing to carry
            doc.target_topk_ids = doc.target_topk_logp = None
        return doc

    def _compute(self, idx: list[int]) -> dict[int, Document]:
        """The rows' documents from padded target forwards over groups of similar lengths (`padded_groups`):
        a micro-batch's documents, padded together, would cost the target ~2x their tokens. A forward is priced
        at `EXTRA_CALL_SHARE` of the rows' tokens, or its launches' worth of tokens where that is more."""
        if self._extract is None:
            raise RuntimeError(f"rows {idx[:8]} were not computed before the target was released: pass every row "
                               "the run reads to `warm` first")
        lengths = [self.lengths[i] for i in idx]
        price = self.extra_call_tokens
        if price is None:
            price = max(EXTRA_CALL_SHARE * sum(lengths), self._launch_tokens)
        out: dict[int, Document] = {}
        for group in padded_groups(lengths, price):
            out.update(self._forward([idx[g] for g in group]))
        return out

    @torch.inference_mode()
    def _forward(self, idx: list[int]) -> dict[int, Document]:
        """One padded target forward over the rows (right padding keeps positions exact). Memory mode
        keeps bf16 features (and top-k log-probs) at `self.home` (host RAM, or the GPU `warm` chose);
        online mode leaves everything on the target's device."""
        ids = [torch.tensor(self.rows[i]["input_ids"], dtype=torch.long) for i in idx]
        n = max(len(x) for x in ids)
        self.forwards.update(forwards=1, positions=len(ids) * n, tokens=sum(len(x) for x in ids))
        batch = torch.zeros(len(ids), n, dtype=torch.long)
        attn = torch.zeros(len(ids), n, dtype=torch.long)
        for j, x in enumerate(ids):
            batch[j, :len(x)] = x
            attn[j, :len(x)] = 1
        device = next(self._extract.model.parameters()).device
        if device.type == "cuda":  # pinned host memory: a copy the GPU runs on its own (no pageable bounce)
            batch, attn = batch.pin_memory(), attn.pin_memory()
        out = self._extract(batch.to(device, non_blocking=True), attention_mask=attn.to(device, non_blocking=True),
                            with_next_tokens=True, topk=self.topk, topk_vocab=self.topk_vocab)
        result = {}
        memory = self.mode == "memory"
        store = torch.bfloat16 if memory else out.features.dtype
        home = self.home if memory else out.features.device
        for j, (i, x) in enumerate(zip(idx, ids, strict=False)):
            t = len(x)
            mask = torch.tensor(self.rows[i]["loss_mask"], dtype=torch.bool)
            # memory mode copies (a view kept on the target's GPU would hold the whole padded batch)
            doc = Document(input_ids=x, loss_mask=mask,
                           features=out.features[j, :t].to(device=home, dtype=store, copy=memory),
                           greedy_next=out.next_tokens[j, :t].to(device=home, copy=memory))
            if self.topk:  # clone: a view would keep the whole padded batch alive
                doc.target_topk_ids = out.topk_ids[j, :t].to(home).clone()
                doc.target_topk_logp = out.topk_logp[j, :t].to(device=home, dtype=store, copy=True)
            result[i] = doc
        return result
