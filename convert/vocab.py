"""Reducing a drafter's vocabulary (formats.md §6) and expanding it back to the target's.

Both need the target's LM head, read straight from its safetensors (no model load): the
reduced head is target rows [t2d]; the expanded drafter borrows the target head outright.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train.errors import CheckpointError, ConfigError
from dflash_train.model.stream import DTYPES, OutTensor, folder_refs
from dflash_train.model.weights import DEFAULT_MAX_SHARD_BYTES
from dflash_train.outputs import plan_output

from .convert import ConvertResult, convert_checkpoint, read_source

_HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")


@dataclass
class TargetHead:
    path: Path
    vocab_size: int
    hidden_size: int
    weight: torch.Tensor  # [V, H]


def _target_folder(target: str | None) -> Path:
    from dflash_train.target import resolve_target

    path = Path(resolve_target(target))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(target), local_files_only=True))
    except Exception as exc:
        raise ConfigError(f"--target {target}: not a local folder and not in the HF cache ({exc}); "
                          "pass a local HF model folder") from exc


def read_target_head(target: str | None) -> TargetHead:
    """The target's output embedding [V, H] (the input embedding when the two are tied)."""
    folder = _target_folder(target)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config
    refs = {r.name: r for r in folder_refs(folder)}
    ref = next((refs[n] for n in _HEAD_NAMES if n in refs), None)
    if ref is None:
        tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", True))
        embeds = [r for n, r in refs.items() if n.endswith("embed_tokens.weight")]
        if not tied or not embeds:
            raise CheckpointError(f"{folder}: no lm_head.weight and no tied embed_tokens.weight; "
                                  "cannot read the target's LM head")
        ref = embeds[0]
    weight = ref.read()
    return TargetHead(folder, int(weight.shape[0]), int(weight.shape[1]), weight)


def _head_for(cfg, target: str | None, flag: str) -> TargetHead:
    head = read_target_head(target)
    if head.vocab_size != cfg.vocab_size or head.hidden_size != cfg.hidden_size:
        raise ConfigError(f"{flag} {target or 'default (embedded SmolLM2)'}: its LM head is "
                          f"[{head.vocab_size}, {head.hidden_size}] but the drafter needs "
                          f"[vocab_size {cfg.vocab_size}, hidden_size {cfg.hidden_size}]; pass the drafter's own target")
    return head


def reduce_vocab(src: str | Path, out: str | Path, token_freq: str | Path, size: int, *,
                 target: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 overwrite: bool = False) -> ConvertResult:
    """Write a speculators drafter whose head keeps the `size` most frequent ids (formats.md §6)."""
    from dflash_train.data.vocab import counts_for_vocab, read_token_freq, reduced_vocab_maps

    sources = [src, token_freq, target]
    plan_output(out, "OUT", sources=sources, overwrite=overwrite)  # before reading the target head
    source = read_source(src)
    cfg = source.config
    if cfg.reduced_vocab:
        raise ConfigError(f"{source.folder}: already reduced (draft_vocab_size {cfg.draft_vocab_size}); "
                          "reduce from the full-vocab drafter")
    counts = read_token_freq(token_freq)
    if counts.numel() > cfg.vocab_size:
        raise ConfigError(f"--token-freq {token_freq}: counts cover {counts.numel()} ids but the drafter's "
                          f"vocab_size is {cfg.vocab_size}")
    counts = counts_for_vocab(counts, cfg.vocab_size, f"--token-freq {token_freq}")  # rows past the tokenizer: 0
    if not 0 < size < cfg.vocab_size:
        raise ConfigError(f"--size {size}: must be in 1..{cfg.vocab_size - 1} (the target vocab is {cfg.vocab_size})")
    head = _head_for(cfg, target, "--target")
    d2t, t2d = reduced_vocab_maps(counts, size)
    dtype = next((DTYPES[r.dtype] for r in source.refs if r.name.endswith("fc.weight")), torch.bfloat16)
    lm_head = head.weight[t2d].to(dtype).contiguous()
    new_cfg = cfg.model_copy(update={"draft_vocab_size": size})
    extra = [OutTensor.of("lm_head.weight", lm_head), OutTensor.of("d2t", d2t), OutTensor.of("t2d", t2d)]
    result = convert_checkpoint(src, out, "speculators", source=source, config=new_cfg, extra=extra,
                                max_shard_bytes=max_shard_bytes, overwrite=overwrite, sources=sources)
    kept = int(counts[t2d].sum())
    total = int(counts.sum()) or 1
    result.notes.append(f"kept {size} of {cfg.vocab_size} ids, covering {kept / total:.2%} of counted tokens; "
                        "lm_head = target LM-head rows [t2d]")
    return result


def expansion_note(draft_head: torch.Tensor, t2d: torch.Tensor, head: TargetHead) -> str:
    """Whether borrowing the target head reproduces the reduced head's logits on the kept ids."""
    rows = head.weight[t2d].to(draft_head.dtype)
    if torch.equal(rows, draft_head):
        return ("expand-vocab: the draft lm_head equals the target's rows [t2d], so logits over the kept ids are "
                "unchanged; the expanded drafter may now also propose ids outside the reduced vocabulary")
    diff = (rows.float() - draft_head.float()).abs().max().item()
    return ("expand-vocab: NOT exact: the draft lm_head differs from the target's rows [t2d] (max abs diff "
            f"{diff:.3g}, it was trained); the expanded drafter uses the target head, so its proposals change: "
            "re-measure acceptance")


def expand_vocab(src: str | Path, out: str | Path, to: str, *, target: str | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False) -> ConvertResult:
    """Drop lm_head/d2t/t2d so the drafter borrows the target head (full vocab again)."""
    sources = [src, target]
    plan_output(out, "OUT", sources=sources, overwrite=overwrite)  # before reading the target head
    source = read_source(src)
    cfg = source.config
    if not cfg.reduced_vocab:
        return convert_checkpoint(src, out, to, source=source, max_shard_bytes=max_shard_bytes,
                                  overwrite=overwrite, sources=sources)
    head = _head_for(cfg, target, "--target")
    refs = {r.name.removeprefix("model."): r for r in source.refs}
    if "lm_head.weight" not in refs or "t2d" not in refs:
        raise CheckpointError(f"{source.folder}: reduced vocab but no lm_head.weight / t2d tensor")
    note = expansion_note(refs["lm_head.weight"].read(), refs["t2d"].read().bool(), head)
    result = convert_checkpoint(src, out, to, source=source, max_shard_bytes=max_shard_bytes,
                                config=cfg.model_copy(update={"draft_vocab_size": cfg.vocab_size}),
                                overwrite=overwrite, sources=sources)
    result.notes.append(note)
    return result
