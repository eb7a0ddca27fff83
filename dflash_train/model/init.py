"""New drafters shaped for a target."""

from __future__ import annotations

import torch

from dflash_train.architectures import architecture
from dflash_train.features.mask_token import check_mask_token_id, default_mask_token_id
from dflash_train.model.config import DFlashConfig
from dflash_train.model.modeling_dflash import DFlashDraftModel
from dflash_train.target import DEFAULT_TARGET_NAME, load_target_config, load_tokenizer, resolve_target


def drafter_config_for_target(target: str | None, *, num_layers: int = 1, block_size: int = 16,
                              mask_token_id: int | None = None, num_features: int = 5,
                              target_layer_ids: list[int] | None = None, intermediate_size: int | None = None,
                              dtype: str = "bfloat16") -> DFlashConfig:
    path = resolve_target(target)
    target_config = load_target_config(path)
    architecture(target_config)
    tokenizer = load_tokenizer(path)
    rows = target_config.get_text_config().vocab_size
    if mask_token_id is None:
        mask_token_id = default_mask_token_id(tokenizer, rows)
    check_mask_token_id(mask_token_id, tokenizer, rows)
    # the verifier is named as the user named the target; the embedded default by its hub id
    verifier = str(target) if target else DEFAULT_TARGET_NAME
    return DFlashConfig.for_target(target_config, num_hidden_layers=num_layers, block_size=block_size,
                                   mask_token_id=mask_token_id, target_layer_ids=target_layer_ids,
                                   num_features=num_features, intermediate_size=intermediate_size,
                                   verifier_name_or_path=verifier, dtype=dtype)


def new_drafter_for_target(target: str | None, seed: int = 0, **kwargs) -> DFlashDraftModel:
    model = DFlashDraftModel(drafter_config_for_target(target, **kwargs))
    model.init_weights(seed=seed)
    return model


def reduce_drafter_vocab(model: DFlashDraftModel, token_counts, draft_vocab_size: int,
                         target_lm_head) -> DFlashDraftModel:
    """A copy of `model` with a reduced draft vocabulary (formats.md §6).

    Keeps the `draft_vocab_size` most frequent supervised ids; the draft `lm_head` starts as the
    target's LM-head rows of the kept ids (and is trained from there); d2t/t2d map between vocabularies.
    """
    import torch

    from dflash_train.data.vocab import counts_for_vocab, reduced_vocab_maps

    cfg = model.config.model_copy(update={"draft_vocab_size": draft_vocab_size})
    reduced = DFlashDraftModel(cfg)
    reduced.load_state_dict(model.state_dict(), strict=False)
    counts = counts_for_vocab(torch.as_tensor(token_counts), cfg.vocab_size, "token counts")
    d2t, t2d = reduced_vocab_maps(counts, draft_vocab_size)
    with torch.no_grad():
        reduced.d2t.copy_(d2t)
        reduced.t2d.copy_(t2d)
        reduced.lm_head.weight.copy_(target_lm_head.detach()[t2d].to(reduced.lm_head.weight.dtype))
    return reduced


# the drafter's norm <- the target layer's norm that plays its part: Gemma's sandwich layers normalise
# the attention *output* in post_attention_layernorm and the MLP input in pre_feedforward_layernorm
_NORMS = {"input_layernorm": ("input_layernorm",),
          "post_attention_layernorm": ("pre_feedforward_layernorm", "post_attention_layernorm"),
          "self_attn.q_norm": ("self_attn.q_norm",), "self_attn.k_norm": ("self_attn.k_norm",)}


def norm_gain(norm) -> torch.Tensor:
    """The per-channel gain a target RMSNorm module applies to a unit-RMS input: its weight for Llama and
    Qwen3, 1 + weight for the zero-centred norms of Gemma and Qwen3-Next / Qwen3.5. Read off the module
    itself, so every form of the formula gives what the drafter's `weight * x_hat` needs."""
    weight = norm.weight
    # a constant row of 1024: its mean square 2^20 swallows any eps in fp32, so x_hat is exactly 1
    probe = torch.full((1, weight.shape[-1]), 1024.0, dtype=torch.float32, device=weight.device)
    with torch.no_grad():
        return norm(probe).float()[0]


def init_from_target_layer(model: DFlashDraftModel, target_model, layer_index: int = -1) -> DFlashDraftModel:
    """Start every draft layer from one target decoder layer and the final norm from the target's.

    The drafter scores with the target's LM head (or its rows), which expects hidden states
    normalised by the target's final norm; and a pretrained layer is a far better start than a
    random one when data or compute is small. Tensors whose shapes differ (a draft narrower than
    the target) and q_norm/k_norm (absent in Llama-style targets) keep their initialisation. Norms are
    copied by what they compute (`norm_gain`), not by their stored weight, which a zero-centred norm
    keeps near 0.
    """
    from dflash_train.features.extract import decoder_layers

    layers = decoder_layers(target_model)
    source_layer = layers[layer_index]
    source = source_layer.state_dict()
    modules = dict(source_layer.named_modules())
    gains = {}
    for mine, theirs in _NORMS.items():
        found = next((modules[n] for n in theirs if n in modules and hasattr(modules[n], "weight")), None)
        if found is not None:
            gains[f"{mine}.weight"] = norm_gain(found)
    norm_names = {f"{n}.weight" for names in _NORMS.values() for n in names}
    with torch.no_grad():
        for layer in model.layers:
            own = layer.state_dict()
            for name, tensor in source.items():
                if name in own and name not in norm_names and own[name].shape == tensor.shape:
                    own[name].copy_(tensor.to(own[name].dtype))
            for name, gain in gains.items():
                if own[name].shape == gain.shape:
                    own[name].copy_(gain.to(own[name].dtype))
        final_norm = (target_model.get_decoder() if hasattr(target_model, "get_decoder") else target_model.model).norm
        gain = norm_gain(final_norm)
        if gain.shape == model.norm.weight.shape:
            model.norm.weight.copy_(gain.to(model.norm.weight.dtype))
    return model
