"""Layer-id conventions: the one place where z-lab ids and speculators/vLLM aux ids meet.

- z-lab / SGLang `target_layer_ids`: id t is the output of target decoder layer t, which is
  HF `hidden_states[t + 1]` (index 0 of `output_hidden_states` is the embedding output).
- speculators / vLLM `aux_hidden_state_layer_ids`: id k is HF `hidden_states[k]`.
So aux = target_layer_id + 1 for every id, and nothing is added implicitly.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_train.errors import ConfigError


def zlab_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """z-lab's formula for `num_features` target layers out of `num_target_layers`, exactly as z-lab
    (and SGLang) compute it when a config names no ids: ids may repeat on small targets."""
    if num_features == 1:
        return [num_target_layers // 2]
    step = (num_target_layers - 4) / (num_features - 1)
    # round() is Python's round-half-to-even, exactly as z-lab computes it
    return [int(round(1 + i * step)) for i in range(num_features)]


def max_default_features(num_target_layers: int) -> int:
    """The most features z-lab's spread (ids 1 .. L-3) gives as distinct layers of an L-layer target."""
    return max(1, num_target_layers - 3)


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """z-lab's default choice, refused when it would repeat a layer or leave the target: a small target
    gets a ConfigError that says how many features it can give and which ids they would be."""
    if num_features < 1:
        raise ConfigError(f"num_features must be >= 1, got {num_features}")
    if num_target_layers < 1:
        raise ConfigError(f"target has {num_target_layers} decoder layers: nothing to read features from")
    ids = zlab_layer_ids(num_target_layers, num_features)
    if ids == sorted(set(ids)) and all(0 <= t < num_target_layers for t in ids):
        return ids
    fewer = max_default_features(num_target_layers)
    raise ConfigError(
        f"num_features: a {num_target_layers}-layer target has too few layers for {num_features} distinct features "
        f"(z-lab's spread would read {ids}); use num_features {fewer} (layer ids "
        f"{zlab_layer_ids(num_target_layers, fewer)}) or pass explicit target layer ids")


def target_to_aux(target_layer_ids: Sequence[int]) -> list[int]:
    return [int(t) + 1 for t in target_layer_ids]


def aux_to_target(aux_layer_ids: Sequence[int]) -> list[int]:
    return [int(k) - 1 for k in aux_layer_ids]


def check_target_layer_ids(target_layer_ids: Sequence[int], num_target_layers: int, field: str) -> None:
    """Raise a ConfigError naming `field` when an id is not a decoder layer of the target."""
    if not target_layer_ids:
        raise ConfigError(f"{field}: at least one layer id is needed")
    for t in target_layer_ids:
        if not 0 <= int(t) < num_target_layers:
            raise ConfigError(
                f"{field}: layer id {t} is outside the target's layers 0..{num_target_layers - 1} "
                f"(z-lab ids; speculators aux ids are these + 1)"
            )
