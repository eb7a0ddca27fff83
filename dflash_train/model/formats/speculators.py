"""The speculators format: what `vllm serve DIR` auto-detects (formats.md §3).

This is the toolkit's native format; every drafter it saves is written here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_train.errors import CheckpointError
from dflash_train.model.config import DFlashConfig

from . import schema
from .body import body_config, body_fields

NAME = "speculators"
SPECULATORS_VERSION = "0.9.0"
# tensors that speculators stores as frozen copies and that we accept and drop on read
DROPPED_ON_READ = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_embed_tokens.weight",
                   "verifier_norm.weight")
# DFlashConfig fields this format has no key for (a round trip through it loses them)
NOT_CARRIED: tuple[str, ...] = ()
SUPPORTS_REDUCED_VOCAB = True


def detect(config: dict[str, Any]) -> bool:
    return "speculators_config" in config and config.get("model_type") in (None, "speculators")


def to_config_dict(cfg: DFlashConfig) -> dict[str, Any]:
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "dtype": cfg.dtype,
        "tie_word_embeddings": False,
        "transformer_layer_config": body_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "block_size": cfg.block_size,
        "aux_hidden_state_layer_ids": list(cfg.aux_hidden_state_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": cfg.sliding_window_non_causal,
        "sample_from_anchor": cfg.sample_from_anchor,
        "num_target_layers": cfg.num_target_layers,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{
                "proposal_type": "greedy",
                "speculative_tokens": cfg.num_speculative_tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": cfg.verifier_name_or_path,
                "architectures": list(cfg.verifier_architectures or []),
            },
        },
    }


def _require(d: dict[str, Any], key: str, where: str):
    if key not in d:
        raise CheckpointError(f"{where}: missing required field `{key}`")
    return d[key]


def from_config_dict(d: dict[str, Any], where: str = "config.json") -> DFlashConfig:
    schema.check(schema.SpeculatorsFile, d, where)
    body = _require(d, "transformer_layer_config", where)
    spec = _require(d, "speculators_config", where)
    methods = spec.get("proposal_methods") or [{}]
    verifier = spec.get("verifier") or {}
    spec_tokens = methods[0].get("speculative_tokens")
    block_size = d.get("block_size") or (spec_tokens + 1 if spec_tokens else None)
    if block_size is None:
        raise CheckpointError(f"{where}: neither `block_size` nor speculative_tokens is set")
    if spec_tokens is not None and d.get("block_size") and spec_tokens != d["block_size"] - 1:
        raise CheckpointError(f"{where}: speculative_tokens {spec_tokens} must be block_size - 1 = "
                              f"{d['block_size'] - 1}")
    return DFlashConfig.build(
        where, CheckpointError,
        hidden_size=_require(body, "hidden_size", f"{where} transformer_layer_config"),
        intermediate_size=_require(body, "intermediate_size", f"{where} transformer_layer_config"),
        num_hidden_layers=_require(body, "num_hidden_layers", f"{where} transformer_layer_config"),
        num_attention_heads=_require(body, "num_attention_heads", f"{where} transformer_layer_config"),
        **body_fields(body),
        vocab_size=_require(body, "vocab_size", f"{where} transformer_layer_config"),
        draft_vocab_size=d.get("draft_vocab_size") or body["vocab_size"],
        target_hidden_size=d.get("target_hidden_size") or body["hidden_size"],
        num_target_layers=d.get("num_target_layers"),
        aux_hidden_state_layer_ids=_require(d, "aux_hidden_state_layer_ids", where),
        block_size=block_size,
        mask_token_id=_require(d, "mask_token_id", where),
        sample_from_anchor=d.get("sample_from_anchor", False),
        sliding_window_non_causal=d.get("sliding_window_non_causal", True),
        verifier_name_or_path=verifier.get("name_or_path"),
        verifier_architectures=verifier.get("architectures") or None,
        dtype=d.get("dtype") or d.get("torch_dtype") or "bfloat16",
    )


def read_config(folder: Path) -> DFlashConfig:
    path = Path(folder) / "config.json"
    return from_config_dict(json.loads(path.read_text()), str(path))
