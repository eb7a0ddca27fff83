"""The target's HF cache during speculative decoding: keep the verified prefix of a verify forward.

A verify forward feeds [x, d_1 .. d_{B-1}] and only x, d_1 .. d_a are kept. Every cache kind
must then look as if only the kept tokens had been fed:

- key/value layers (full attention, MLA): crop the rejected positions (the fast path; a target
  made only of these never copies anything).
- sliding-window layers: the same crop, possible once transformers records the window's past
  (`activate_past_recording`), which it needs to give back positions it would have evicted. A
  recording layer holds every position fed since its last crop, and transformers before 5.18 hands
  all of them to attention while the mask covers only the window (a shape error on the GPU machine's
  5.17): every forward this class does not crop after (the prefill, a re-feed) is settled by a
  `crop(0)` before the next one (`settle`), which trims the layer back to its window.
- recurrent layers (Gated DeltaNet in Qwen3-Next / Qwen3.5; any `LinearAttention` cache layer):
  their state has no positions to crop. Before each verify forward we snapshot their conv and
  recurrent states (small, fixed-size tensors); on a rejection we put the snapshot back, crop
  every key/value layer back to the block's start and re-feed the kept tokens. That is exact:
  the cache then holds what feeding the kept tokens alone gives.
"""

from __future__ import annotations

import torch

from dflash_train.target import cache_arg


def _recurrent(layer) -> bool:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return isinstance(layer, LinearAttentionCacheLayerMixin)


def _crop_kv(layer, tokens_to_remove: int) -> None:
    """Crop the key/value part of a cache layer by `tokens_to_remove` (>= 0); a combined linear +
    attention layer crops through its attention class only (the linear part is restored instead)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    for klass in type(layer).__mro__:
        if "crop" in vars(klass) and not issubclass(klass, LinearAttentionCacheLayerMixin):
            klass.crop(layer, -tokens_to_remove)
            return


class TargetCache:
    """An HF DynamicCache for `target` that can drop the rejected tail of every verify forward."""

    def __init__(self, target):
        from transformers import DynamicCache

        self.cache = DynamicCache(config=target.config)
        for layer in self.cache.layers:  # sliding-window layers keep what a crop may need to give back
            if not _recurrent(layer) and hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        self.recurrent = [i for i, layer in enumerate(self.cache.layers) if _recurrent(layer)]
        self._snapshot: dict[int, tuple[dict, dict, torch.Tensor | None]] | None = None

    def length(self) -> int:
        return self.cache.get_seq_length()

    def settle(self) -> None:
        """Trim recording sliding-window layers back to their window (no position is removed)."""
        for layer in self.cache.layers:
            if getattr(layer, "record_past", False) and getattr(layer, "is_initialized", True):
                _crop_kv(layer, 0)

    def before_verify(self) -> None:
        """Settle the sliding-window layers and remember the recurrent layers' states (nothing to copy for
        caches made of key/value layers)."""
        self.settle()
        if not self.recurrent:
            return
        self._snapshot = {}
        for i in self.recurrent:
            layer = self.cache.layers[i]
            # transformers 5.25 counts a linear layer's tokens itself (`cumulative_length_linear`, what
            # `get_seq_length` returns for it): it is part of the state a rejection puts back
            count = getattr(layer, "cumulative_length_linear", None)
            self._snapshot[i] = ({k: None if v is None else v.clone() for k, v in layer.conv_states.items()},
                                 {k: None if v is None else v.clone() for k, v in layer.recurrent_states.items()},
                                 None if count is None else count.clone())

    @torch.no_grad()
    def keep(self, target, fed: torch.Tensor, kept: int) -> None:
        """After a verify forward of `fed` [1, n] tokens, keep only its first `kept` positions."""
        rejected = fed.shape[1] - kept
        if not self.recurrent or rejected == 0:
            for layer in self.cache.layers:
                if not _recurrent(layer) or hasattr(layer, "keys"):
                    _crop_kv(layer, rejected)
            self._snapshot = None
            return
        if self._snapshot is None:
            raise RuntimeError("TargetCache.keep: call before_verify() before the verify forward")
        for layer_index, layer in enumerate(self.cache.layers):
            if layer_index in self._snapshot:
                conv, rec, count = self._snapshot[layer_index]
                layer.conv_states.update(conv)
                layer.recurrent_states.update(rec)
                if count is not None:
                    layer.cumulative_length_linear.copy_(count)
            if not _recurrent(layer) or hasattr(layer, "keys"):
                _crop_kv(layer, fed.shape[1])
        self._snapshot = None
        target(input_ids=fed[:, :kept], **cache_arg(target, self.cache), use_cache=True)
        self.settle()
