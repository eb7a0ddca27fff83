"""Greedy decoding of one left-padded group over a transformers `StaticCache`, without `generate`.

transformers' `generate` (5.17, the GPU machines') does host work around every decode step: it grows
`input_ids` and the attention mask by concatenation, rebuilds the model inputs and runs the stopping criteria.
(Its "all rows finished" read is deferred by one step there, `DeferredStopCheck`, so the host does not wait
for the device each step: less for this loop to win than its first reading assumed.) On an H200 at 8275a25
SmolLM2's regeneration ran ~8 ms a decode step (23.9K new tokens/s over 512 rows), where the step's weight
and KV reads take ~1.5 ms. This loop made 30.8K new tokens/s on the same rows at 304cfdf (another H200, another
day; `generate`'s row in that run was cut, docs/gpu.md).

Here, per group: one eager prefill (logits of the last position only), then each decode step is one call of
the compiled model (with mode "reduce-overhead", a CUDA graph replay) and a few small device ops (argmax,
the token written into a device buffer, the finished rows updated). Nothing is read back until every
`CHECK_EVERY` steps, when one flag says whether every row has finished. The model is called with what
`generate` passes it, so the tokens are greedy search's:
- position ids: the prompt's own (mask cumsum - 1, pads at 0), then prompt length + step;
- the cache, which counts the positions written itself (a device counter in transformers 5.17 and later;
  passed as `past_key_values` there, as `cache` since 5.24);
- logits of the last position only (`logits_to_keep=1`);
- the 2D attention mask at the cache's full length, ones past the prompt: the causal mask hides the
  positions not yet written, where `generate` pads its shorter mask with zeros to the same effect.
A row that has finished keeps decoding until the group stops (rows do not interact), as in `generate`; its
tokens after the stop are dropped by the caller, and at most `CHECK_EVERY - 1` steps run after the last row
finishes.
"""

from __future__ import annotations

from dflash_train.greedy import greedy_ids
from dflash_train.target import cache_kwarg

CHECK_EVERY = 16  # decode steps between two reads of "has every row finished" (one host sync each)


def compiled_forward(model, compile_config, device: str):
    """The decode step's model call: compiled as `generate` compiles it (transformers' `get_compiled_call`,
    its default config: inductor, mode "reduce-overhead") on CUDA, or anywhere when `compile_config` has
    `_compile_all_devices` (the tests, on CPU); else the eager call."""
    from transformers import CompileConfig

    config = compile_config if compile_config is not None else CompileConfig()
    if device == "cuda" or getattr(config, "_compile_all_devices", False):
        return model.get_compiled_call(config)
    return model.__call__


def greedy_decode(model, step, ids, mask, cache, max_new_tokens: int, stop_ids: list[int], pad_id: int,
                  shrink: bool = False):
    """Greedy tokens [rows, <= max_new_tokens] (device) of a left-padded group: `ids`, `mask` [rows, width] on
    the model's device, `cache` a StaticCache of width + max_new_tokens positions (reset), `step` the decode
    step's model call (`compiled_forward`). Each row's tokens run to its first stop id and past it, or are
    `pad_id` once the row had finished by an earlier step.

    `shrink` (a CPU's, whose step costs about its rows): at a check where at least a quarter of the rows still
    decoding have finished, they leave the batch, their cache rows with them (`reorder_cache`, beam search's
    reordering, which also takes a subset), so the rest decode at the cost of their own rows; the cache is then
    smaller than it was made. The step must take any row count (eager)."""
    import torch

    rows, width = ids.shape
    device = ids.device
    cache_kw = cache_kwarg(model)
    full_mask = torch.ones((rows, width + max_new_tokens), dtype=mask.dtype, device=device)
    full_mask[:, :width] = mask
    prompt_len = mask.sum(-1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
    with torch.no_grad():  # as `generate`
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                    **{cache_kw: cache})
        token = greedy_ids(out.logits[:, -1])
        del out  # the prefill's logits and activations, before the decode steps' CUDA graph pools
        tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        alive = None  # after a shrink: each decoding row's row in `tokens`
        for k in range(max_new_tokens):
            if alive is None:
                tokens[:, k] = torch.where(done, pad_id, token)
            else:
                tokens[alive, k] = torch.where(done, pad_id, token)
            done |= torch.isin(token, stops)
            check = (k + 1) % CHECK_EVERY == 0
            if k + 1 == max_new_tokens or (check and bool(done.all())):
                return tokens[:, :k + 1]
            if shrink and check and 4 * int(done.sum()) >= len(done):
                keep = (~done).nonzero().squeeze(1)
                cache.reorder_cache(keep)
                alive = keep if alive is None else alive[keep]
                full_mask, prompt_len, token, done = (t[keep] for t in (full_mask, prompt_len, token, done))
            # the argmax is taken at once and no reference to the logits is kept: with CUDA graphs the next
            # replay writes over this one's outputs
            token = greedy_ids(step(input_ids=token[:, None], attention_mask=full_mask,
                                    position_ids=(prompt_len + k)[:, None], use_cache=True, logits_to_keep=1,
                                    **{cache_kw: cache}).logits[:, -1])
    return tokens
