import pytest
import torch

from dflash_train.model.init import init_from_target_layer, new_drafter_for_target


def test_draft_layers_start_from_a_target_layer_and_its_final_norm(smollm2):
    target, _ = smollm2
    draft = new_drafter_for_target(None, num_layers=2, block_size=8, seed=1)
    q_norm_before = draft.layers[0].self_attn.q_norm.weight.clone()
    init_from_target_layer(draft, target, layer_index=-2)
    source = target.model.layers[-2]
    for layer in draft.layers:
        assert torch.equal(layer.mlp.gate_proj.weight, source.mlp.gate_proj.weight)
        assert torch.equal(layer.self_attn.k_proj.weight, source.self_attn.k_proj.weight)
        assert torch.equal(layer.post_attention_layernorm.weight, source.post_attention_layernorm.weight)
    assert torch.equal(draft.norm.weight, target.model.norm.weight)
    # Llama layers have no q_norm/k_norm: those keep their initialisation, and fc stays random
    assert torch.equal(draft.layers[0].self_attn.q_norm.weight, q_norm_before)
    assert draft.fc.weight.shape == (576, 5 * 576)


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_next", "qwen3"])
def test_draft_norms_compute_what_the_target_norms_compute(tiny_target, model_type):
    """Gemma's and Qwen3-Next's norms are zero-centred (gain 1 + weight): copying the stored weight would
    scale every hidden state by ~0. The drafter's norms must give the target's output on the same input,
    and its pre-MLP norm is the one Gemma's sandwich layer puts before its MLP."""
    from transformers import AutoModelForCausalLM

    from dflash_train.model.modeling_dflash import DFlashRMSNorm

    target = AutoModelForCausalLM.from_pretrained(str(tiny_target(model_type)), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random gains, so a copy of the raw weight cannot pass by luck
        for module in target.modules():
            if "RMSNorm" in type(module).__name__ and getattr(module, "weight", None) is not None:
                module.weight.copy_(0.3 * torch.randn(module.weight.shape, generator=g))
    hidden = target.config.get_text_config().hidden_size
    draft = new_drafter_for_target(str(tiny_target(model_type)), num_layers=1, block_size=8, seed=1,
                                   num_features=1, intermediate_size=32)
    init_from_target_layer(draft, target, layer_index=-1)
    source = target.model.layers[-1]
    pre_mlp = getattr(source, "pre_feedforward_layernorm", None) or source.post_attention_layernorm
    x = torch.randn(3, hidden, generator=g)
    pairs = [(draft.norm, target.model.norm), (draft.layers[0].input_layernorm, source.input_layernorm),
             (draft.layers[0].post_attention_layernorm, pre_mlp)]
    for mine, theirs in pairs:
        assert isinstance(mine, DFlashRMSNorm)
        torch.testing.assert_close(mine(x), theirs(x), atol=1e-5, rtol=1e-5)
