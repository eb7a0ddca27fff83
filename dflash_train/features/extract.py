"""Context features from a frozen target: concatenated hidden states of chosen layers.

`TargetFeatures.__call__` returns, for every token t, `concat_i hidden_states[ids[i] + 1][t]`
(z-lab ids) and, when asked, the target's greedy next token at t. When only features are
wanted, the forward stops after the deepest layer needed: we capture decoder-layer outputs
with forward hooks and abort the rest of the stack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_train.features.layer_ids import check_target_layer_ids


class _StopForward(Exception):
    pass


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder-layer list of an HF causal LM (Llama, Qwen2/3, Mistral, Gemma, ...)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layers (expected .model.layers)")
    return layers


def num_target_layers(model) -> int:
    return len(decoder_layers(model))


@dataclass
class FeatureBatch:
    features: torch.Tensor  # [B, T, n * H]
    next_tokens: torch.Tensor | None  # [B, T] greedy next token at each position, or None
    logits: torch.Tensor | None = None  # [B, T, V] only when return_logits


class TargetFeatures:
    """Runs a target and returns aux features (and optionally greedy tokens / logits)."""

    def __init__(self, model, target_layer_ids: Sequence[int]):
        self.model = model
        self.layer_ids = [int(t) for t in target_layer_ids]
        self.num_layers = num_target_layers(model)
        check_target_layer_ids(self.layer_ids, self.num_layers, "target_layer_ids")

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 with_next_tokens: bool = False, return_logits: bool = False) -> FeatureBatch:
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        # the last decoder layer's HF hidden state is post-norm: only a full forward gives it
        full = with_next_tokens or return_logits or max(self.layer_ids) == self.num_layers - 1
        if full:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             output_hidden_states=True, use_cache=False)
            feats = torch.cat([out.hidden_states[t + 1] for t in self.layer_ids], dim=-1)
            logits = out.logits
            return FeatureBatch(feats, logits.argmax(-1), logits if return_logits else None)
        return FeatureBatch(self._truncated(input_ids, attention_mask), None)

    def _truncated(self, input_ids, attention_mask) -> torch.Tensor:
        layers = decoder_layers(self.model)
        deepest = max(self.layer_ids)
        captured: dict[int, torch.Tensor] = {}

        def hook(index):
            def fn(_module, _inputs, output):
                captured[index] = output[0] if isinstance(output, tuple) else output
                if index == deepest:
                    raise _StopForward
            return fn

        handles = [layers[t].register_forward_hook(hook(t)) for t in sorted(set(self.layer_ids))]
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        try:
            base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        return torch.cat([captured[t] for t in self.layer_ids], dim=-1)
