"""Tiny targets and drafters with hand-set weights, whose decoding is known in advance.

Target (LlamaForCausalLM, hidden 32, vocab 8): embeddings are one-hot, every decoder layer's
o_proj/down_proj is zero, so each hidden state is the token's one-hot and the final norm
scales it by sqrt(32). The LM head then gives logits = log-probabilities (stochastic table) or
a single 1/sqrt(32)-scaled winner (a `next_table`: greedy next token = next_table[token]).

Drafters (1 layer, 1 head of dim 8, z-lab layer id 0 = HF hidden_states[1] = the one-hot):
- `constant_drafter`: every weight of the layer zero, so a MASK slot's hidden is the MASK
  embedding and every slot proposes the target head's choice for MASK (next_table[MASK]).
- `copy_drafter`: slot k (position m) attends, through RoPE at frequency 2*pi/P, to the context
  positions n < p with m - n = 1 (mod P), copies their token x_{m-1} and the head maps it to
  next(x_{m-1}). On a history that repeats with period P this is exactly the target's token,
  so every slot is right (tau = B). `reduced=True` does the same through a reduced-vocab head
  (lm_head + d2t/t2d) instead of the target's head.
"""

from __future__ import annotations

import math

import torch

HIDDEN = 32
VOCAB = 8
MASK = 7
SCALE = math.sqrt(HIDDEN)  # final RMSNorm of a one-hot vector


def _base_target(eps: float = 1e-6):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                      max_position_embeddings=512, rms_norm_eps=eps, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :VOCAB] = torch.eye(VOCAB)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
    return model.eval().requires_grad_(False)


def cycle_target(next_table: list[int]):
    """Greedy next token of token i is next_table[i]."""
    assert len(next_table) == VOCAB
    model = _base_target()
    with torch.no_grad():
        for i, j in enumerate(next_table):
            model.lm_head.weight[j, i] = 1.0
    return model


def markov_target(probs: torch.Tensor):
    """probs [V, V] rows = P(next | token); logits at temperature 1 are log-probabilities."""
    model = _base_target(eps=1e-12)
    with torch.no_grad():
        logp = torch.log(probs.clamp(min=1e-30)).clamp(min=-60.0)
        model.lm_head.weight[:, :VOCAB] = logp.t() / SCALE  # weight[j, i] = log P(j | i) / scale
    return model


def _drafter_config(block_size: int, period: int, draft_vocab: int = VOCAB):
    from dflash_train.model.config import DFlashConfig

    omega = 2 * math.pi / period
    # head_dim 8: inv_freq[1] = rope_theta ** (-1/4) is the frequency of dims (1, 5)
    return DFlashConfig(hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
                        num_key_value_heads=1, head_dim=8, vocab_size=VOCAB, draft_vocab_size=draft_vocab,
                        target_hidden_size=HIDDEN, num_target_layers=2, aux_hidden_state_layer_ids=[1],
                        block_size=block_size, mask_token_id=MASK, rope_theta=omega ** -4, rms_norm_eps=1e-6,
                        dtype="float32")


def _zeroed(cfg):
    from dflash_train.model.modeling_dflash import DFlashDraftModel

    model = DFlashDraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.zero_()
    return model.eval()


def constant_drafter(block_size: int = 4):
    """Every slot proposes the target head's choice for the MASK token."""
    return _zeroed(_drafter_config(block_size, period=4))


def copy_drafter(block_size: int, period: int, next_table: list[int], reduced: bool = False):
    """Exact drafter for a history that repeats with `period` (see the module docstring)."""
    kept = sorted(set(next_table[:MASK]))
    cfg = _drafter_config(block_size, period, draft_vocab=len(kept) if reduced else VOCAB)
    model = _zeroed(cfg)
    omega = 2 * math.pi / period
    attn = model.layers[0].self_attn
    s, g = 4.0, 4.0
    with torch.no_grad():
        # context = hidden_norm(fc(one-hot x)) = 4 * (e[8 + x] + e[16]): token id and a constant marker
        for i in range(VOCAB):
            model.fc.weight[8 + i, i] = 1.0
            model.fc.weight[16, i] = 1.0
        # query: MASK slots only, along rotary dim 1 (phase 0)
        attn.q_proj.weight[1, MASK] = 1.0
        attn.q_norm.weight.zero_()
        attn.q_norm.weight[[1, 5]] = s
        # key: context only (the marker), phase omega, so the score peaks at m - n = 1 (mod period)
        attn.k_proj.weight[1, 16] = math.cos(omega)
        attn.k_proj.weight[5, 16] = math.sin(omega)
        attn.k_norm.weight.zero_()
        attn.k_norm.weight[[1, 5]] = s
        # value: the context token's one-hot
        for j in range(VOCAB):
            attn.v_proj.weight[j, 8 + j] = 1.0
        if not reduced:
            for j in range(VOCAB):  # into the token dims: the target head maps token j to next(j)
                attn.o_proj.weight[j, j] = g
        else:
            for j in range(VOCAB):
                attn.o_proj.weight[24 + j, j] = g
            model.lm_head.weight.zero_()
            for j in range(MASK):
                model.lm_head.weight[kept.index(next_table[j]), 24 + j] = 1.0
            kept_t = torch.tensor(kept)
            model.d2t.copy_(kept_t - torch.arange(len(kept)))
            model.t2d.zero_()
            model.t2d[kept_t] = True
    return model
