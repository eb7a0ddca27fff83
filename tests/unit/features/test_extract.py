import pytest
import torch

from dflash_train.errors import ConfigError
from dflash_train.features.extract import TargetFeatures
from dflash_train.features.layer_ids import default_target_layer_ids


@pytest.fixture(scope="module")
def ids():
    return torch.randint(20, 49000, (2, 24), generator=torch.Generator().manual_seed(0))


def test_features_are_hidden_states_t_plus_one(smollm2, ids):
    model, _ = smollm2
    layer_ids = default_target_layer_ids(30, 5)
    out = TargetFeatures(model, layer_ids)(ids, with_next_tokens=True)
    ref = model(ids, output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[t + 1] for t in layer_ids], dim=-1)
    assert out.features.shape == (2, 24, 5 * 576)
    torch.testing.assert_close(out.features, expected, rtol=0, atol=1e-5)
    assert torch.equal(out.next_tokens, ref.logits.argmax(-1))


def test_feature_only_run_stops_early_and_agrees(smollm2, ids):
    model, _ = smollm2
    calls = []
    handle = model.model.layers[29].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        extractor = TargetFeatures(model, [1, 8, 14])
        short = extractor(ids)
        assert calls == []  # layer 29 never ran
        full = extractor(ids, with_next_tokens=True)
        assert calls == [1]
    finally:
        handle.remove()
    assert short.next_tokens is None
    torch.testing.assert_close(short.features, full.features, rtol=0, atol=1e-5)


def test_last_layer_uses_hf_post_norm_state(smollm2, ids):
    model, _ = smollm2
    out = TargetFeatures(model, [29])(ids)
    ref = model(ids, output_hidden_states=True).hidden_states[30]
    torch.testing.assert_close(out.features, ref, rtol=0, atol=1e-5)


def test_layer_id_beyond_target_is_rejected(smollm2):
    with pytest.raises(ConfigError, match="layer id 30 is outside"):
        TargetFeatures(smollm2[0], [1, 30])
