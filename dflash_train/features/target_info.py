"""What `dflash-train target-info` says about a target: the facts a user needs before a first run."""

from __future__ import annotations

import os

from dflash_train.errors import ConfigError


def describe_target(target: str | os.PathLike | None, num_features: int = 5) -> dict:
    """Path, architecture, layer count, default layer ids (fewer, with a note, when the target is too
    small for `num_features` distinct layers), a spare mask token and the engines that serve it."""
    from dflash_train.architectures import architecture, serve_line
    from dflash_train.features.layer_ids import default_target_layer_ids, max_default_features, target_to_aux
    from dflash_train.features.mask_token import default_mask_token_id
    from dflash_train.target import load_target_config, load_tokenizer, resolve_target

    path = resolve_target(target)
    config = load_target_config(path)
    arch = architecture(config)
    cfg = config.get_text_config()
    layers = cfg.num_hidden_layers
    note = None
    try:
        ids = default_target_layer_ids(layers, num_features)
    except ConfigError as exc:
        if num_features < 1:
            raise
        note = str(exc)
        ids = default_target_layer_ids(layers, max_default_features(layers))
    try:
        mask = default_mask_token_id(load_tokenizer(path), cfg.vocab_size)
    except ConfigError as exc:
        mask = f"none ({exc})"
    info = {"path": path, "architecture": arch.model_type,
            "architectures": list(getattr(config, "architectures", None) or []), "kind": arch.kind,
            "num_hidden_layers": layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "target_layer_ids": ids, "aux_hidden_state_layer_ids": target_to_aux(ids), "mask_token_id": mask,
            "vllm_serves_dflash": arch.vllm, "sglang_serves_dflash": arch.sglang, "serve": serve_line(arch)}
    import torch

    from dflash_train.machine import auto_dtype

    dtype, why = auto_dtype("cuda" if torch.cuda.is_available() else "cpu")
    info["auto_dtype"] = f"{dtype} ({why})"  # what `auto` dtypes and precision pick on this machine
    if layer_types := getattr(cfg, "layer_types", None):
        info["layer_types"] = sorted(set(layer_types))
    if note:
        info["note"] = note
    return info
