import pytest

from dflash_train.errors import ConfigError
from dflash_train.features.layer_ids import (
    aux_to_target,
    check_target_layer_ids,
    default_target_layer_ids,
    target_to_aux,
)

# golden lists from formats.md §2 (z-lab's own choices for real targets)
GOLDEN = [
    (36, 5, [1, 9, 17, 25, 33]),   # Qwen3-8B
    (30, 5, [1, 8, 14, 20, 27]),   # SmolLM2-135M
    (32, 5, [1, 8, 15, 22, 29]),   # Llama-3.1-8B
    (36, 1, [18]),
    (28, 3, [1, 13, 25]),
]


@pytest.mark.parametrize("layers,n,expected", GOLDEN)
def test_default_ids_match_golden(layers, n, expected):
    assert default_target_layer_ids(layers, n) == expected


def test_round_half_to_even_is_used():
    # L=30, N=5: 1 + 2*6.5 = 14.0 exact; L=34, N=5: step 7.5 -> 1+7.5=8.5 rounds to 8 (half to even)
    assert default_target_layer_ids(34, 5)[1] == 8
    assert default_target_layer_ids(34, 5)[3] == int(round(1 + 3 * 7.5))


def test_aux_is_target_plus_one_every_id_kept():
    ids = [1, 9, 17, 25, 33]
    aux = target_to_aux(ids)
    assert aux == [2, 10, 18, 26, 34]
    assert aux_to_target(aux) == ids


def test_check_rejects_ids_outside_target():
    check_target_layer_ids([0, 29], 30, "layer_ids")
    with pytest.raises(ConfigError, match=r"layer_ids: layer id 30 is outside the target's layers 0\.\.29"):
        check_target_layer_ids([1, 30], 30, "layer_ids")


@pytest.mark.parametrize("layers", range(1, 40))
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_default_ids_are_distinct_increasing_and_inside_or_refused_with_a_proposal(layers, n):
    from dflash_train.features.layer_ids import max_default_features

    try:
        ids = default_target_layer_ids(layers, n)
    except ConfigError as exc:
        fewer = max_default_features(layers)
        assert n > fewer
        msg = str(exc)
        assert f"{layers}-layer target" in msg and f"use num_features {fewer}" in msg
        proposal = default_target_layer_ids(layers, fewer)  # the proposal itself is valid
        assert str(proposal) in msg
        return
    assert len(ids) == n and ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < layers


def test_six_layer_target_no_longer_repeats_a_layer():
    with pytest.raises(ConfigError, match=r"would read \[1, 2, 2, 2, 3\]\); use num_features 3 \(layer ids \[1, 2, 3\]\)"):
        default_target_layer_ids(6, 5)
    assert default_target_layer_ids(6, 3) == [1, 2, 3]


def test_zlab_formula_is_kept_verbatim_for_reading_zlab_configs():
    from dflash_train.features.layer_ids import zlab_layer_ids

    assert zlab_layer_ids(6, 5) == [1, 2, 2, 2, 3]  # what z-lab / SGLang compute for a config without ids
    assert zlab_layer_ids(36, 5) == default_target_layer_ids(36, 5)
