"""Context features from a frozen target: concatenated outputs of chosen decoder layers.

Feature id t is the output of decoder layer t, captured by a forward hook on that layer
(`capture_layers`), in every architecture: dense, MoE (the layer's output, never a router's),
hybrid (linear-attention layers are layers too), and for the last layer too, where it is the
residual stream before the final norm. That is what vLLM serves as aux hidden state t + 1 (and
SGLang as target layer t); HF's `hidden_states[t + 1]` is the same except at the last layer,
where HF applies the final norm, so the toolkit never reads `hidden_states`.

`TargetFeatures.__call__` returns, for every token, the features and, when asked, the target's
greedy next token and its top-k next-token log-probabilities (the kl loss's teacher). When only
features are wanted, the forward stops after the deepest layer needed.

Top-k (`head_outputs`): the LM head runs over `_HEAD_CHUNK` positions at a time and only the
argmax and the k largest log-probabilities survive a chunk, so the [T, V] fp32 logits of a long
batch are never all alive (49,152 x 4 bytes per token for SmolLM2; k = 32 keeps 384).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_train.features.layer_ids import check_target_layer_ids
from dflash_train.greedy import greedy_ids

_HEAD_CHUNK = 256  # positions per LM-head call when only the argmax / top-k are kept


class _StopForward(Exception):
    pass


@torch.no_grad()
def head_outputs(head, final: torch.Tensor, topk: int | None = None, chunk: int = _HEAD_CHUNK,
                 vocab: torch.Tensor | None = None, greedy: bool | torch.Tensor = True):
    """(greedy [B, T] long, top-k ids [B, T, k] int32, top-k log-probs [B, T, k] fp32) of the LM head
    `head` over post-norm states `final` [B, T, H], `chunk` positions (over the whole batch) at a
    time; the top-k pair is None when `topk` is None. Log-probabilities are normalised over the
    whole vocabulary (fp32 log-softmax), sorted largest first.

    `vocab` (sorted target ids, e.g. a drafter's reduced vocabulary): the top k over those ids only, normalised
    over them, from the head's rows of those ids (a twelfth of SmolLM2's head for 4,096 ids); the ids returned
    are target ids. `greedy=False`: no argmax (None), so with `vocab` the whole head never runs. `greedy` a bool
    [B, T] mask: the argmax at those positions only (-1 at the others), their rows alone through the whole head;
    except with a top k over the whole head, which computes every position's argmax anyway."""
    shape = final.shape[:2]
    flat = final.reshape(-1, final.shape[-1])
    n = flat.shape[0]
    where = greedy.reshape(-1).to(final.device) if isinstance(greedy, torch.Tensor) else None
    if where is not None and topk and vocab is None:
        where, greedy = None, True  # the top k over the whole head computes every position's argmax anyway
    if where is None and vocab is None and not greedy:
        raise ValueError("head_outputs: greedy=False needs a vocab (the top-k over the whole head gives the argmax)")
    if vocab is not None:  # moved to the device once, not per chunk
        vocab = vocab.to(head.weight.device)
    rows = head.weight[vocab] if vocab is not None else None
    if where is not None:  # the argmax at some positions: their rows alone go through the whole head
        out = torch.full((n,), -1, dtype=torch.long, device=final.device)
        picked = where.nonzero().squeeze(1)
        for s in range(0, picked.numel(), chunk):
            out[picked[s: s + chunk]] = greedy_ids(head(flat[picked[s: s + chunk]]))
        greedy = False
    else:
        out = torch.empty(n, dtype=torch.long, device=final.device) if greedy else None
    ids = logp = None
    if topk:
        ids = torch.empty((n, topk), dtype=torch.int32, device=final.device)
        logp = torch.empty((n, topk), dtype=torch.float32, device=final.device)
    for s in range(0, n, chunk):
        x = flat[s: s + chunk]
        logits = head(x) if greedy else None
        if greedy:
            out[s: s + chunk] = greedy_ids(logits)
        if topk:
            scores = logits if rows is None else torch.nn.functional.linear(x, rows)
            values, index = torch.log_softmax(scores.float(), -1).topk(topk, dim=-1)
            ids[s: s + chunk] = index if vocab is None else vocab[index]
            logp[s: s + chunk] = values
        del logits
    greedy_tokens = out.view(shape) if out is not None else None
    if not topk:
        return greedy_tokens, None, None
    return greedy_tokens, ids.view(*shape, topk), logp.view(*shape, topk)


def vocab_tag(vocab: torch.Tensor) -> str:
    """A short fingerprint of a set of target ids (the vocabulary a top-k teacher was taken over)."""
    import hashlib

    return f"{vocab.numel()}-" + hashlib.sha256(vocab.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:10]


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder-layer list of an HF causal LM (Llama, Qwen2/3, Mistral, Gemma, ...)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layers (expected .model.layers)")
    return layers


def num_target_layers(model) -> int:
    return len(decoder_layers(model))


def decoder(model):
    """The decoder stack without the LM head."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


class capture_layers:
    """`with capture_layers(model, ids) as cap: model(...)`: forward hooks record the outputs of the decoder
    layers `ids`; `cap.features()` concatenates them in the order of `ids`. With `stop_after`, the forward
    is aborted once that layer has run (the layers above and the head never run)."""

    def __init__(self, model, layer_ids: Sequence[int], stop_after: int | None = None):
        self.layers = decoder_layers(model)
        self.layer_ids = [int(t) for t in layer_ids]
        self.stop_after = stop_after
        self.captured: dict[int, torch.Tensor] = {}
        self._handles = []

    def _hook(self, index: int):
        def fn(_module, _inputs, output):
            self.captured[index] = output[0] if isinstance(output, tuple) else output
            if index == self.stop_after:
                raise _StopForward
        return fn

    def __enter__(self) -> capture_layers:
        self._handles = [self.layers[t].register_forward_hook(self._hook(t)) for t in sorted(set(self.layer_ids))]
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        for h in self._handles:
            h.remove()
        return exc_type is _StopForward  # the planned early stop is no error

    def features(self) -> torch.Tensor:
        return torch.cat([self.captured[t] for t in self.layer_ids], dim=-1)


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
                 with_next_tokens: bool = False, topk: int | None = None,
                 topk_vocab: torch.Tensor | None = None) -> FeatureBatch:
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        head = with_next_tokens or bool(topk)
        with capture_layers(self.model, self.layer_ids, None if head else max(self.layer_ids)) as cap:
            out = decoder(self.model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        if not head:
            return FeatureBatch(cap.features(), None)
        # the head runs chunk-wise over the final-norm states: no [B, T, V] logits
        greedy, ids, logp = head_outputs(self.model.get_output_embeddings(), out.last_hidden_state, topk,
                                         vocab=topk_vocab, greedy=with_next_tokens or topk_vocab is None)
        return FeatureBatch(cap.features(), greedy, ids, logp)
