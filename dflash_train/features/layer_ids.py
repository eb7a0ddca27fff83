"""Layer-id conventions: the one place where z-lab ids and speculators/vLLM aux ids meet.

- z-lab / SGLang `target_layer_ids`: id t is the output of target decoder layer t, which is
  HF `hidden_states[t + 1]` (index 0 of `output_hidden_states` is the embedding output).
- speculators / vLLM `aux_hidden_state_layer_ids`: id k is HF `hidden_states[k]`.
So aux = target_layer_id + 1 for every id, and nothing is added implicitly.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_train.errors import ConfigError


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """z-lab's default choice of `num_features` target layers out of `num_target_layers`."""
    if num_features < 1:
        raise ConfigError(f"num_features must be >= 1, got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    if num_target_layers < 5:
        raise ConfigError(f"target has {num_target_layers} layers: too few for {num_features} features; "
                          "pass explicit layer ids")
    step = (num_target_layers - 4) / (num_features - 1)
    # round() is Python's round-half-to-even, exactly as z-lab computes it
    return [int(round(1 + i * step)) for i in range(num_features)]


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


def last_layer_warning(target_layer_ids: Sequence[int], num_target_layers: int) -> str | None:
    """A warning when the ids include the target's last decoder layer, where engines disagree:
    HF `hidden_states[L]` (what training extracts) is after the final norm, while vLLM 0.32
    collects aux id L as the residual stream before it. Other layers are the same everywhere."""
    if num_target_layers - 1 not in [int(t) for t in target_layer_ids]:
        return None
    return (f"target layer id {num_target_layers - 1} is the target's last decoder layer: training reads HF's "
            "post-norm hidden state there, vLLM serves the pre-norm residual stream, so served acceptance can "
            f"fall below the trained one; prefer ids <= {num_target_layers - 2}")
