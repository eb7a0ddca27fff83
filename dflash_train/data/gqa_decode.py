"""The target's attention for HF regeneration and the eval's batched verify: transformers' SDPA, except that a
short query (a decode step, a speculative block) attends on the K/V heads as they are stored, also under
`torch.compile`.

With an attention mask (left-padded groups always have one), transformers' SDPA path repeats every K/V head
`num_key_value_groups` times (`repeat_kv`) for any query of more than one token, and inside the compiled decode
step for one token too: a copy of the whole KV cache, `groups` times its size, written and read again every step
(SmolLM2: 3x; Qwen3-8B: 4x). Outside compilation transformers already avoids that for one-token queries by
folding the query heads of a group into the query length (`pack_gqa`): (batch, heads, 1, dim) -> (batch,
kv_heads, groups, dim), so one SDPA call reads each cached K/V head once. This does the same in the compiled step,
and for a block of up to `BLOCK_QUERIES` query tokens over a longer cache (the eval's batched verify of a drafted
block: its per-query mask, shared by the heads, is tiled over the folded groups). The mask of a decode step is
shared by all heads, (batch, 1, 1, kv_len), and broadcasts over the folded axes unchanged.

Prefill (a query as long as its keys, longer than a block, or without a mask), models without GQA and anything
unusual (a position bias, softcap) go to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

BLOCK_QUERIES = 16  # the longest query folded: a drafted block verified over the cache
NAME = "sdpa_gqa_decode"  # not "flash..." anywhere: transformers takes such names for flash kernels


def gqa_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         is_causal=None, **kwargs):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, dim = query.shape
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1
    # a block needs its mask: without one transformers takes a longer query as causal from the first key
    block = q_len == 1 or (attention_mask is not None and q_len <= BLOCK_QUERIES and key.shape[2] > q_len)
    plain = (not block or groups == 1 or not shared_mask or key.shape[-1] != value.shape[-1]
             or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
             or kwargs.get("output_attentions", False))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # heads h*groups+g of kv head h, each query token i of head g at g*q_len+i
    folded = query.reshape(batch, heads // groups, groups * q_len, dim)
    mask = attention_mask
    if mask is not None and q_len > 1:  # (batch, 1, q_len, kv_len) -> (batch, 1, groups*q_len, kv_len)
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], 1, groups * q_len, -1)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    # (batch, kv_heads, groups*q_len, dim) -> (batch, q_len, heads, dim), what the attention layers expect
    return out.reshape(batch, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_gqa_decode(model) -> None:
    """Switch `model` (an HF causal LM) to this attention; its masks stay transformers' SDPA masks."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, gqa_decode_attention)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)


@contextmanager
def folded_gqa(model):
    """`model` attends with this attention inside the block where it attended with transformers' SDPA, as before
    after it (a trainer's target, lent to the eval mid-run, keeps its own setting)."""
    before = model.config._attn_implementation
    if before != "sdpa":
        yield
        return
    use_gqa_decode(model)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
