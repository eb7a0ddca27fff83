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
