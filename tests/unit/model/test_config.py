"""model/config.py: the drafter config carries the target's rope, whatever its type."""

import pytest
import torch

from dflash_train.model.config import DFlashConfig, drafter_rope


def _target(model_type, **fields):
    from transformers import AutoConfig

    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    return AutoConfig.for_model(model_type, **{**base, **fields})


YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 128, "rope_theta": 150000.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 512, "rope_theta": 500000.0}


@pytest.mark.parametrize("model_type, rope", [("gpt_oss", YARN), ("llama", LLAMA3),
                                              ("qwen3", {"rope_type": "default", "rope_theta": 1e6})])
def test_every_rope_parameter_reaches_the_drafter_and_its_frequencies(model_type, rope):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dflash_train.model.modeling_dflash import DFlashRotary

    cfg = DFlashConfig.for_target(_target(model_type, rope_parameters=dict(rope)), mask_token_id=999,
                                  target_layer_ids=[1, 3])
    assert cfg.rope_parameters == rope and cfg.rope_theta == rope["rope_theta"]
    rotary = DFlashRotary(cfg)  # the KeyError of issue 24 was raised here for yarn
    if rope["rope_type"] != "default":  # the drafter's frequencies are the ones transformers computes for that rope
        hf = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=4096,
                         rope_parameters=dict(rope))
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, None)
        torch.testing.assert_close(rotary.inv_freq, inv_freq)
        assert rotary.scaling == pytest.approx(scaling)


def test_per_layer_type_rope_takes_the_full_attention_entry():
    tc = _target("gemma3_text", sliding_window=8, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert drafter_rope(tc) == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}


def test_target_only_rope_keys_stay_behind():
    tc = _target("qwen3_next", rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                "partial_rotary_factor": 0.25})
    assert drafter_rope(tc) == {"rope_type": "default", "rope_theta": 1e7}


def test_the_parameter_count_from_the_config_is_the_models():
    """What the training refuses a too-large drafter by, before any allocation, counted from the config."""
    import torch

    from dflash_train.model.config import DFlashConfig
    from dflash_train.model.modeling_dflash import DFlashDraftModel

    for bias, draft_vocab, layers in ((False, 1000, 2), (True, 500, 3)):
        cfg = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=1000, draft_vocab_size=draft_vocab,
                           target_hidden_size=48, aux_hidden_state_layer_ids=[2, 4, 6], block_size=8, mask_token_id=3,
                           attention_bias=bias)
        with torch.device("meta"):
            model = DFlashDraftModel(cfg)
        assert cfg.num_parameters == sum(p.numel() for p in model.parameters())
