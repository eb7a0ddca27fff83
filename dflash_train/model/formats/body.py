"""The draft body: a complete qwen3 config dict, shared by the speculators and z-lab formats.

speculators nests it under `transformer_layer_config`; z-lab writes it at the top level. Every
field is written out explicitly because vLLM fills no defaults.
"""

from __future__ import annotations

from typing import Any

from dflash_train.model.config import DFlashConfig


def body_config(cfg: DFlashConfig) -> dict[str, Any]:
    """The complete qwen3 config of the draft body: vLLM fills no defaults."""
    body = {
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": cfg.rope,
        "tie_word_embeddings": False,
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
    }
    if cfg.layer_types is not None:
        body["layer_types"] = list(cfg.layer_types)
    return body


def body_fields(body: dict[str, Any]) -> dict[str, Any]:
    """DFlashConfig fields read back from a qwen3 body dict, with qwen3's defaults for the optional
    ones; the caller has checked hidden_size, num_attention_heads and vocab_size are present."""
    rope = body.get("rope_parameters") or {}
    return {
        "num_key_value_heads": body.get("num_key_value_heads") or body["num_attention_heads"],
        "head_dim": body.get("head_dim") or body["hidden_size"] // body["num_attention_heads"],
        "hidden_act": body.get("hidden_act", "silu"),
        "rms_norm_eps": body.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": body.get("max_position_embeddings", 32768),
        "attention_bias": body.get("attention_bias", False),
        "rope_theta": body.get("rope_theta", rope.get("rope_theta", 1_000_000.0)),
        "rope_parameters": rope or None,
        "layer_types": body.get("layer_types"),
        "sliding_window": body.get("sliding_window") if body.get("use_sliding_window") else None,
    }
