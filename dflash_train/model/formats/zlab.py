"""The z-lab native format: what SGLang and HF `trust_remote_code` read (formats.md §4).

The only module that speaks z-lab names (`target_layer_ids`, `dflash_config`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_train.errors import CheckpointError
from dflash_train.features.layer_ids import aux_to_target, target_to_aux
from dflash_train.model.config import DFlashConfig

from . import schema
from .body import body_config, body_fields

NAME = "zlab"
DROPPED_ON_READ: tuple[str, ...] = ()
# DFlashConfig fields this format has no key for (a round trip through it loses them)
NOT_CARRIED: tuple[str, ...] = ("verifier_architectures", "sample_from_anchor", "sliding_window_non_causal")
SUPPORTS_REDUCED_VOCAB = False
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}


def detect(config: dict[str, Any]) -> bool:
    return "dflash_config" in config or "DFlashDraftModel" in (config.get("architectures") or [])


def to_config_dict(cfg: DFlashConfig) -> dict[str, Any]:
    if cfg.reduced_vocab:
        raise CheckpointError("z-lab format: SGLang cannot serve a reduced-vocab drafter "
                              f"(draft_vocab_size {cfg.draft_vocab_size} < vocab_size {cfg.vocab_size}); "
                              "rebuild a full-vocab head with --expand-vocab")
    target_ids = aux_to_target(cfg.aux_hidden_state_layer_ids)
    out = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": AUTO_MAP,
        **body_config(cfg),
        "torch_dtype": cfg.dtype,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "target_layer_ids": target_ids,
            "mask_token_id": cfg.mask_token_id,
            "block_size": cfg.block_size,
        },
    }
    if cfg.verifier_name_or_path:
        out["target_model_name_or_path"] = cfg.verifier_name_or_path
    return out


def _lookup(d: dict[str, Any], key: str):
    """SGLang's rule: dflash_config first, then top level."""
    inner = d.get("dflash_config") or {}
    if key in inner:
        return inner[key]
    return d.get(key)


def from_config_dict(d: dict[str, Any], where: str = "config.json", mask_token_id: int | None = None) -> DFlashConfig:
    schema.check(schema.ZlabFile, d, where)
    target_ids = _lookup(d, "target_layer_ids")
    if target_ids is None:
        raise CheckpointError(f"{where}: missing `dflash_config.target_layer_ids`")
    block_size = _lookup(d, "block_size")
    if block_size is None:
        raise CheckpointError(f"{where}: missing `block_size` (top level or in dflash_config)")
    mask = _lookup(d, "mask_token_id")
    if mask is None:
        mask = mask_token_id
    if mask is None:
        raise CheckpointError(f"{where}: no `dflash_config.mask_token_id`; this folder names its mask by "
                              f"string ({_lookup(d, 'mask_token') or '<|MASK|>'}): pass --mask-token-id")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in d:
            raise CheckpointError(f"{where}: missing required field `{key}`")
    return DFlashConfig.build(
        where, CheckpointError,
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        **body_fields(d),
        vocab_size=d["vocab_size"],
        draft_vocab_size=d["vocab_size"],
        target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
        num_target_layers=d.get("num_target_layers"),
        aux_hidden_state_layer_ids=target_to_aux(target_ids),
        block_size=block_size,
        mask_token_id=mask,
        verifier_name_or_path=d.get("target_model_name_or_path"),
        dtype=d.get("torch_dtype") or d.get("dtype") or "bfloat16",
    )


def read_config(folder: Path) -> DFlashConfig:
    path = Path(folder) / "config.json"
    return from_config_dict(json.loads(path.read_text()), str(path))
