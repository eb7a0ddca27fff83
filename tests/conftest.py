"""Shared fixtures. The real SmolLM2 target is converted once per machine and cached."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_path():
    from dflash_train.features.target import default_target_path

    return default_target_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(model, tokenizer) of the real SmolLM2-135M-Instruct target, fp32, frozen."""
    from dflash_train.features.target import load_target

    return load_target(str(smollm2_path), dtype=torch.float32)


@pytest.fixture
def tiny_config():
    """A small drafter config (GQA, 2 layers) for fast model tests."""
    from dflash_train.model.config import DFlashConfig

    return DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=101, draft_vocab_size=101,
                        target_hidden_size=64, num_target_layers=8, aux_hidden_state_layer_ids=[2, 4, 6],
                        block_size=8, mask_token_id=100, rope_theta=10000.0, dtype="float32")
