"""Context features from a frozen target: concatenated hidden states of chosen layers.

`TargetFeatures.__call__` returns, for every token t, `concat_i hidden_states[ids[i] + 1][t]`
(z-lab ids) and, when asked, the target's greedy next token at t and its top-k next-token
log-probabilities (the kl loss's teacher). When only features are wanted, the forward stops
after the deepest layer needed: we capture decoder-layer outputs with forward hooks and abort
the rest of the stack.

Top-k (`head_outputs`): the LM head runs over `_HEAD_CHUNK` positions at a time and only the
argmax and the k largest log-probabilities survive a chunk, so the [T, V] fp32 logits of a long
batch are never all alive (49,152 x 4 bytes per token for SmolLM2; k = 32 keeps 384).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_train.features.layer_ids import check_target_layer_ids

_HEAD_CHUNK = 256  # positions per LM-head call when only the argmax / top-k are kept


class _StopForward(Exception):
    pass


@torch.no_grad()
def head_outputs(head, final: torch.Tensor, topk: int | None = None, chunk: int = _HEAD_CHUNK):
    """(greedy [B, T] long, top-k ids [B, T, k] int32, top-k log-probs [B, T, k] fp32) of the LM head
    `head` over post-norm states `final` [B, T, H], `chunk` positions (over the whole batch) at a
    time; the top-k pair is None when `topk` is None. Log-probabilities are normalised over the
    whole vocabulary (fp32 log-softmax), sorted largest first."""
    shape = final.shape[:2]
    flat = final.reshape(-1, final.shape[-1])
    n = flat.shape[0]
    greedy = torch.empty(n, dtype=torch.long, device=final.device)
    ids = logp = None
    if topk:
        ids = torch.empty((n, topk), dtype=torch.int32, device=final.device)
        logp = torch.empty((n, topk), dtype=torch.float32, device=final.device)
    for s in range(0, n, chunk):
        logits = head(flat[s: s + chunk])
        greedy[s: s + chunk] = logits.argmax(-1)
        if topk:
            values, index = torch.log_softmax(logits.float(), -1).topk(topk, dim=-1)
            ids[s: s + chunk], logp[s: s + chunk] = index, values
        del logits
    if not topk:
        return greedy.view(shape), None, None
    return greedy.view(shape), ids.view(*shape, topk), logp.view(*shape, topk)


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
    topk_ids: torch.Tensor | None = None  # [B, T, k] int32, only when topk was asked for
    topk_logp: torch.Tensor | None = None  # [B, T, k] fp32 log-probabilities of topk_ids


class TargetFeatures:
    """Runs a target and returns aux features (and optionally greedy tokens / top-k log-probs)."""

    def __init__(self, model, target_layer_ids: Sequence[int]):
        self.model = model
        self.layer_ids = [int(t) for t in target_layer_ids]
        self.num_layers = num_target_layers(model)
        check_target_layer_ids(self.layer_ids, self.num_layers, "target_layer_ids")

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 with_next_tokens: bool = False, topk: int | None = None) -> FeatureBatch:
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if topk or with_next_tokens:
            # the decoder without its head, then the head chunk-wise keeping only the argmax (and top-k):
            # never the [B, T, V] logits (4-8 GB for a 4K-token batch at a 151,936 vocabulary)
            base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
            out = base(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
            feats = torch.cat([out.hidden_states[t + 1] for t in self.layer_ids], dim=-1)
            greedy, ids, logp = head_outputs(self.model.get_output_embeddings(), out.last_hidden_state, topk)
            return FeatureBatch(feats, greedy, ids, logp)
        # the last decoder layer's HF hidden state is post-norm: only a full forward gives it
        if max(self.layer_ids) == self.num_layers - 1:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             output_hidden_states=True, use_cache=False)
            feats = torch.cat([out.hidden_states[t + 1] for t in self.layer_ids], dim=-1)
            return FeatureBatch(feats, out.logits.argmax(-1))
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
