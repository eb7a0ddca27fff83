"""Config rules the engines enforce when they load a drafter folder (formats.md §3-4).

One small named function per rule, grouped per format name (`RULES`). Each takes the raw
config dict and returns None (pass), `Fail(reason)` or `Warn(reason)`; the reason names the
field. `convert.validate` runs them beside the tensor and target checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dflash_train.model.checks import Fail, Warn
from dflash_train.model.formats import speculators, zlab

Outcome = Fail | Warn | None
Rule = Callable[[dict[str, Any]], Outcome]

BODY_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
               "max_position_embeddings", "attention_bias", "rope_theta")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _all_full_attention(body: dict[str, Any]) -> bool:
    return all(t == "full_attention" for t in body.get("layer_types") or []) and not body.get("use_sliding_window")


def _check_layer_ids(ids, field: str, low: int, num_target_layers, high_offset: int) -> Outcome:
    if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
        return Fail(f"`{field}` must be a non-empty list of ints, got {ids!r}")
    if min(ids) < low:
        return Fail(f"`{field}` {ids}: ids must be >= {low}")
    if len(set(ids)) != len(ids):
        return Fail(f"`{field}` {ids}: repeated id")
    if _is_int(num_target_layers) and max(ids) + high_offset > num_target_layers:
        return Fail(f"`{field}` {ids} reach past num_target_layers {num_target_layers}")
    return None


# ------------------------------------------------------------------------------------------
# speculators (vLLM's auto path)
def spec_model_type(d) -> Outcome:
    if d.get("model_type") not in (None, "speculators"):
        return Fail(f"`model_type` is {d['model_type']!r}; a speculators config has none (vLLM would load "
                    "it as a plain model)")
    return None


def spec_speculators_model_type(d) -> Outcome:
    if d.get("speculators_model_type") != "dflash":
        return Fail(f"`speculators_model_type` is {d.get('speculators_model_type')!r}, must be \"dflash\"")
    return None


def spec_architectures(d) -> Outcome:
    if d.get("architectures") != ["DFlashSpeculator"]:
        return Fail(f"`architectures` is {d.get('architectures')!r}, must be [\"DFlashSpeculator\"]")
    return None


def spec_algorithm(d) -> Outcome:
    algo = (d.get("speculators_config") or {}).get("algorithm")
    if algo != "dflash":
        return Fail(f"`speculators_config.algorithm` is {algo!r}, must be \"dflash\"")
    return None


def spec_speculative_tokens(d) -> Outcome:
    spec = d.get("speculators_config") or {}
    methods = spec.get("proposal_methods")
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
        return Fail("`speculators_config.proposal_methods` is missing or empty")
    k = methods[0].get("speculative_tokens")
    if not _is_int(k) or k < 1:
        return Fail(f"`speculators_config.proposal_methods[0].speculative_tokens` is {k!r}; vLLM reads it as "
                    "num_speculative_tokens (block_size - 1)")
    if _is_int(d.get("block_size")) and k != d["block_size"] - 1:
        return Fail(f"`speculators_config.proposal_methods[0].speculative_tokens` {k} != block_size - 1 "
                    f"({d['block_size'] - 1})")
    if not spec.get("default_proposal_method"):
        return Fail("`speculators_config.default_proposal_method` is missing")
    return None


def spec_verifier(d) -> Outcome:
    verifier = (d.get("speculators_config") or {}).get("verifier") or {}
    name = verifier.get("name_or_path")
    if not name:
        return Fail("`speculators_config.verifier.name_or_path` is missing; vLLM's auto path serves this model")
    if str(name).startswith(("/", ".", "~")):
        return Warn(f"`speculators_config.verifier.name_or_path` is a local path ({name}); vLLM's auto path "
                    "needs a hub id (use the explicit --speculative-config path, or --verifier ORG/NAME)")
    if not verifier.get("architectures"):
        return Warn("`speculators_config.verifier.architectures` is empty; pass --verifier with a readable config")
    return None


def spec_body_complete(d) -> Outcome:
    body = d.get("transformer_layer_config")
    if not isinstance(body, dict):
        return Fail("`transformer_layer_config` is missing")
    missing = [k for k in BODY_FIELDS if k not in body]
    if missing:
        return Fail(f"`transformer_layer_config.{missing[0]}` is missing (vLLM fills no defaults)" +
                    (f"; also {missing[1:]}" if len(missing) > 1 else ""))
    if body["model_type"] != "qwen3":
        return Fail(f"`transformer_layer_config.model_type` is {body['model_type']!r}, must be \"qwen3\"")
    return None


def spec_rope(d) -> Outcome:
    body = d.get("transformer_layer_config") or {}
    rope = body.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope or "rope_type" not in rope:
        return Fail(f"`transformer_layer_config.rope_parameters` is {rope!r}; write "
                    "{\"rope_type\": ..., \"rope_theta\": ...} (the draft must use the target's rope)")
    return None


def spec_vocab(d) -> Outcome:
    vocab = (d.get("transformer_layer_config") or {}).get("vocab_size")
    dv = d.get("draft_vocab_size")
    if not _is_int(dv) or dv < 1:
        return Fail(f"`draft_vocab_size` is {dv!r}; write the target vocab (or the reduced size)")
    if _is_int(vocab) and dv > vocab:
        return Fail(f"`draft_vocab_size` {dv} exceeds transformer_layer_config.vocab_size {vocab}")
    return None


def spec_target_hidden_size(d) -> Outcome:
    if not _is_int(d.get("target_hidden_size")):
        return Fail(f"`target_hidden_size` is {d.get('target_hidden_size')!r}; vLLM sizes fc from it")
    return None


def spec_aux_ids(d) -> Outcome:
    if "aux_hidden_state_layer_ids" not in d:
        return Fail("`aux_hidden_state_layer_ids` is missing (required; aux = z-lab id + 1)")
    return _check_layer_ids(d["aux_hidden_state_layer_ids"], "aux_hidden_state_layer_ids", 1,
                            d.get("num_target_layers"), 0)


def spec_mask_token_id(d) -> Outcome:
    mask = d.get("mask_token_id")
    vocab = (d.get("transformer_layer_config") or {}).get("vocab_size")
    if not _is_int(mask) or mask < 0:
        return Fail(f"`mask_token_id` is {mask!r}; it is required")
    if _is_int(vocab) and mask >= vocab:
        return Fail(f"`mask_token_id` {mask} is outside the vocab ({vocab})")
    return None


def spec_non_causal(d) -> Outcome:
    if d.get("sliding_window_non_causal") is False and _all_full_attention(d.get("transformer_layer_config") or {}):
        return Fail("`sliding_window_non_causal` is false on an all-full-attention draft: vLLM 0.33 then runs "
                    "every layer causal and silently loses acceptance; write true")
    return None


def spec_sample_from_anchor(d) -> Outcome:
    if d.get("sample_from_anchor"):
        return Fail("`sample_from_anchor` is true; vLLM's DFlash proposer needs false")
    return None


def spec_tie_word_embeddings(d) -> Outcome:
    if d.get("tie_word_embeddings", False) is not False:
        return Fail("`tie_word_embeddings` must be false (the drafter owns no embedding)")
    return None


# ------------------------------------------------------------------------------------------
# z-lab (SGLang and HF remote code)
def _zlab(d, key):
    return zlab._lookup(d, key)


def zlab_model_type(d) -> Outcome:
    if d.get("model_type") != "qwen3":
        return Fail(f"`model_type` is {d.get('model_type')!r}, must be \"qwen3\"")
    return None


def zlab_architectures(d) -> Outcome:
    if "DFlashDraftModel" not in (d.get("architectures") or []):
        return Fail(f"`architectures` is {d.get('architectures')!r}, must contain \"DFlashDraftModel\"")
    return None


def zlab_body_complete(d) -> Outcome:
    missing = [k for k in BODY_FIELDS if k not in d]
    if missing:
        return Fail(f"`{missing[0]}` is missing at the top level" + (f"; also {missing[1:]}" if len(missing) > 1 else ""))
    return None


def zlab_block_size(d) -> Outcome:
    inner, top = (d.get("dflash_config") or {}).get("block_size"), d.get("block_size")
    value = _zlab(d, "block_size")
    if not _is_int(value) or value < 2:
        return Fail(f"`block_size` is {value!r} (top level / dflash_config); it must be an int >= 2")
    if inner is not None and top is not None and inner != top:
        return Fail(f"`dflash_config.block_size` {inner} disagrees with top-level `block_size` {top}")
    return None


def zlab_target_layer_ids(d) -> Outcome:
    ids = _zlab(d, "target_layer_ids")
    if ids is None:
        return Fail("`dflash_config.target_layer_ids` is missing")
    return _check_layer_ids(ids, "dflash_config.target_layer_ids", 0, d.get("num_target_layers"), 1)


def zlab_mask(d) -> Outcome:
    mask = _zlab(d, "mask_token_id")
    if mask is None:
        if isinstance(_zlab(d, "mask_token"), str):
            return Warn(f"`dflash_config.mask_token_id` is missing; SGLang looks up `mask_token` "
                        f"{_zlab(d, 'mask_token')!r} in the tokenizer")
        return Fail("`dflash_config.mask_token_id` is missing (SGLang would look up \"<|MASK|>\")")
    if not _is_int(mask) or mask < 0 or (_is_int(d.get("vocab_size")) and mask >= d["vocab_size"]):
        return Fail(f"`dflash_config.mask_token_id` {mask!r} is not an id inside vocab_size {d.get('vocab_size')}")
    return None


def zlab_num_target_layers(d) -> Outcome:
    if not _is_int(d.get("num_target_layers")):
        return Warn("`num_target_layers` is missing; readers use it to check the layer ids")
    return None


def zlab_hidden_matches_target(d) -> Outcome:
    th = d.get("target_hidden_size")
    if th is not None and th != d.get("hidden_size"):
        return Fail(f"`target_hidden_size` {th} != `hidden_size` {d.get('hidden_size')}: SGLang requires the "
                    "draft hidden size to equal the target's")
    return None


RULES: dict[str, list[Rule]] = {
    speculators.NAME: [spec_model_type, spec_speculators_model_type, spec_architectures, spec_algorithm,
                       spec_speculative_tokens, spec_verifier, spec_body_complete, spec_rope, spec_vocab,
                       spec_target_hidden_size, spec_aux_ids, spec_mask_token_id, spec_non_causal,
                       spec_sample_from_anchor, spec_tie_word_embeddings],
    zlab.NAME: [zlab_model_type, zlab_architectures, zlab_body_complete, zlab_block_size, zlab_target_layer_ids,
                zlab_mask, zlab_num_target_layers, zlab_hidden_matches_target],
}
