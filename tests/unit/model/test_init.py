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
