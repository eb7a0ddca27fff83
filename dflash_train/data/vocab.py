"""Token frequencies over supervised tokens and reduced draft vocabularies (formats.md §6).

token_freq.json: {"vocab_size": V, "total": N, "counts": [V ints]} counted over loss-masked
(assistant) tokens only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from dflash_train.errors import DataError

TOKEN_FREQ_FILE = "token_freq.json"


def count_token_frequencies(rows: Iterable[tuple[Iterable[int], Iterable[int]]], vocab_size: int) -> torch.Tensor:
    """Counts [V] over tokens whose loss_mask is 1; rows are (input_ids, loss_mask) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in rows:
        ids_t = torch.as_tensor(ids if isinstance(ids, torch.Tensor) else list(ids), dtype=torch.long)
        mask_t = torch.as_tensor(mask if isinstance(mask, torch.Tensor) else list(mask), dtype=torch.bool)
        counts += torch.bincount(ids_t[mask_t], minlength=vocab_size)[:vocab_size]
    return counts


def training_token_frequencies(rows, train_rows: list[int], all_counts: torch.Tensor) -> torch.Tensor:
    """Counts [V] over the supervised tokens of `train_rows` only, so a reduced draft vocabulary
    never sees the held-out answers it is measured on.

    `rows` is the prepared dataset (`input_ids`, `loss_mask`) and `all_counts` its token_freq.json
    (every row). The smaller side is counted: the training rows themselves, or the rest (held out,
    or left out by `data.train_fraction`) subtracted from `all_counts`.
    """
    others = sorted(set(range(len(rows))) - set(train_rows))
    if not others:
        return all_counts.clone()
    side = train_rows if len(train_rows) <= len(others) else others
    picked = rows.select(side).with_format("torch", columns=["input_ids", "loss_mask"])  # a row at a time
    counts = count_token_frequencies(((r["input_ids"], r["loss_mask"]) for r in picked), all_counts.numel())
    return counts if side is train_rows else all_counts - counts


def write_token_freq(path: str | Path, counts: torch.Tensor) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"vocab_size": int(counts.numel()), "total": int(counts.sum()),
                               "counts": counts.tolist()}))
    tmp.replace(path)


def read_token_freq(path: str | Path) -> torch.Tensor:
    path = Path(path)
    if path.is_dir():
        path = path / TOKEN_FREQ_FILE
    try:
        data = json.loads(path.read_text())
        counts = torch.tensor(data["counts"], dtype=torch.long)
    except FileNotFoundError as exc:
        raise DataError(f"{path}: token frequency file not found; `dflash-train prepare` writes one") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path}: not a token_freq.json file (needs `counts`, a list of ints): {exc}") from exc
    if counts.numel() != data.get("vocab_size", counts.numel()):
        raise DataError(f"{path}: `counts` has {counts.numel()} entries but vocab_size is {data['vocab_size']}")
    return counts


def counts_for_vocab(counts: torch.Tensor, vocab_size: int, where: str) -> torch.Tensor:
    """Token counts over a target's `vocab_size` embedding rows. Prepare counts over the tokenizer's ids;
    a target may have more rows than its tokenizer has ids (Qwen: 151,665 ids, 151,936 rows): the spare
    rows never occur in text and count 0. More counts than rows means another target's counts."""
    if counts.numel() > vocab_size:
        raise DataError(f"{where}: counts cover {counts.numel()} ids but the target has {vocab_size} embedding rows; "
                        "use the token_freq.json prepared for this target")
    if counts.numel() < vocab_size:
        counts = torch.cat([counts, counts.new_zeros(vocab_size - counts.numel())])
    return counts


def reduced_vocab_maps(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] int64 offsets, t2d [V] bool) keeping the Vd most frequent ids.

    Ties go to the lower id; when fewer than Vd ids were seen, the lowest unused ids pad the
    set; kept ids are sorted ascending and d2t[i] = kept[i] - i.
    """
    vocab = counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise DataError(f"draft vocab size {draft_vocab_size} must be in 1..{vocab}")
    ids = torch.arange(vocab)
    seen = counts > 0
    # sort by (-count, id): a stable sort on -count over ids in ascending order breaks ties by id
    order = torch.sort(-counts, stable=True).indices
    top = order[:draft_vocab_size]
    top = top[seen[top]]
    if top.numel() < draft_vocab_size:
        unused = ids[~seen][: draft_vocab_size - top.numel()]
        top = torch.cat([top, unused])
    kept = torch.sort(top).values
    d2t = (kept - torch.arange(draft_vocab_size)).to(torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d
