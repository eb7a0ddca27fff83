"""Tiny drafters written by the toolkit's own savers, for the convert tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_train.model.checkpoint import save_drafter
from dflash_train.model.config import DFlashConfig
from dflash_train.model.modeling_dflash import DFlashDraftModel


def tiny_cfg(**kw) -> DFlashConfig:
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=101, draft_vocab_size=101, target_hidden_size=64,
                num_target_layers=8, aux_hidden_state_layer_ids=[2, 4, 6], block_size=8, mask_token_id=100,
                rope_theta=10000.0, dtype="bfloat16", verifier_name_or_path="org/tiny-target",
                verifier_architectures=["Qwen3ForCausalLM"])
    base.update(kw)
    return DFlashConfig(**base)


def smollm2_cfg(**kw) -> DFlashConfig:
    """Shaped for the embedded SmolLM2 target (hidden 576, 30 layers, vocab 49152), one small layer."""
    base = dict(hidden_size=576, intermediate_size=64, num_hidden_layers=1, num_attention_heads=9,
                num_key_value_heads=3, head_dim=64, vocab_size=49152, draft_vocab_size=49152,
                target_hidden_size=576, num_target_layers=30, aux_hidden_state_layer_ids=[2, 15, 28],
                block_size=4, mask_token_id=16, rope_theta=100000.0, dtype="float32",
                verifier_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    base.update(kw)
    return DFlashConfig(**base)


def write_drafter(folder: Path, cfg: DFlashConfig | None = None, seed: int = 0, **save_kw) -> Path:
    model = DFlashDraftModel(cfg or tiny_cfg())
    model.init_weights(seed=seed)
    if model.lm_head is not None:  # make the vocab maps a real reduced vocab: every 3rd id kept
        vd, v = model.config.draft_vocab_size, model.config.vocab_size
        kept = torch.arange(vd) * (v // vd)
        model.d2t.copy_(kept - torch.arange(vd))
        model.t2d.zero_()
        model.t2d[kept] = True
    return save_drafter(model, folder, **save_kw)


def read_config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def write_config(folder: Path, data: dict) -> None:
    (Path(folder) / "config.json").write_text(json.dumps(data, indent=2))


def edit_tensors(folder: Path, fn) -> None:
    """Rewrite model.safetensors through `fn(dict) -> dict`."""
    path = Path(folder) / "model.safetensors"
    tensors = fn(load_file(str(path)))
    save_file(tensors, str(path), metadata={"format": "pt"})


def all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from dflash_train.model.weights import read_tensors

    return read_tensors(folder)
