"""Tiny random-weight targets, one per architecture in the registry (dflash_train/architectures.py).

Each is built from a config here (no download) with a real tokenizer and chat template (the Qwen asset for
Qwen-family targets, with Qwen's 151,936-row vocabulary; SmolLM2's, 49,152 rows, for the others): 4 decoder
layers (6 for Gemma 3, whose 5:1 sliding pattern needs them), hidden 64, so a forward takes milliseconds.
Architecture quirks the toolkit must handle are kept: linear-attention layers between full ones
(qwen3_next, qwen3_5), MoE routers, sliding windows shorter than the test prompts, gpt-oss's yarn rope
and attention sinks, DeepSeek's MLA, partial rotary (qwen3_next, minimax_m2).
"""

from __future__ import annotations

_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True)
_HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

CONFIGS: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": dict(**_MOE, decoder_sparse_step=1),
    "qwen3_next": dict(**_MOE, **_HYBRID, shared_expert_intermediate_size=32),
    "qwen3_5_text": dict(**_HYBRID),
    "qwen3_5_moe_text": dict(**_MOE, **_HYBRID, shared_expert_intermediate_size=32),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 64,
                                     "rope_theta": 150000.0}),
    "gemma3_text": dict(num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=16),
    "deepseek_v3": dict(head_dim=None, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2, rotary_dim=8),
}


def make_tiny_target(model_type: str, folder, tokenizer_folder, **overrides):
    """Save a tiny random `model_type` target (seed 0) with the tokenizer of `tokenizer_folder`; returns folder.
    `overrides` change config fields (vLLM's CPU attention needs head_dim >= 32, for instance)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    # the embedding has the published model's rows: Qwen's 151,936 (spare rows past the tokenizer), else the tokenizer's
    vocab = 151936 if len(tok) == 151665 else len(tok)
    fields = {**_COMMON, "vocab_size": vocab, "num_hidden_layers": 4, **CONFIGS[model_type], **overrides}
    fields = {k: v for k, v in fields.items() if v is not None or k == "sliding_window"}
    cfg = AutoConfig.for_model(model_type, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
