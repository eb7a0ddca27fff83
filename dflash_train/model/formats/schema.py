"""The shape of a drafter's config.json, typed: every reader checks it here first.

A config.json is JSON written by people and other tools: `[]`, `"block_size": "eight"` or a
`speculators_config` that is a list are refused with one line naming the file, the field and
what it should be, before any reader looks inside. The schemas list only the fields the toolkit
reads, with the types it needs; other keys pass through untouched (HF configs carry many).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from dflash_train.errors import CheckpointError
from dflash_train.model.config import MAX_BLOCK_SIZE

Count = Field(default=None, gt=0)
# the weight dtypes a drafter is stored in (what vLLM and HF accept for these configs)
Dtype = Literal["float32", "bfloat16", "float16"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class Body(_Lenient):
    """The qwen3 config of the draft body (speculators `transformer_layer_config`, z-lab top level)."""

    vocab_size: StrictInt | None = Count
    hidden_size: StrictInt | None = Count
    intermediate_size: StrictInt | None = Count
    num_hidden_layers: StrictInt | None = Count
    num_attention_heads: StrictInt | None = Count
    num_key_value_heads: StrictInt | None = Count
    head_dim: StrictInt | None = Count
    hidden_act: StrictStr | None = None
    rms_norm_eps: float | None = Field(default=None, gt=0)
    max_position_embeddings: StrictInt | None = Count
    attention_bias: StrictBool | None = None
    rope_theta: float | None = Field(default=None, gt=0)
    rope_parameters: dict[str, Any] | None = None
    use_sliding_window: StrictBool | None = None
    sliding_window: StrictInt | None = Count
    layer_types: list[StrictStr] | None = None


class ProposalMethod(_Lenient):
    speculative_tokens: StrictInt | None = Count


class Verifier(_Lenient):
    name_or_path: StrictStr | None = None
    architectures: list[StrictStr] | None = None


class SpeculatorsSection(_Lenient):
    algorithm: StrictStr | None = None
    proposal_methods: list[ProposalMethod] | None = None
    verifier: Verifier | None = None


class _DraftFields(_Lenient):
    """What both formats carry at the top level of config.json."""

    block_size: StrictInt | None = Field(default=None, gt=0, le=MAX_BLOCK_SIZE)
    mask_token_id: StrictInt | None = Field(default=None, ge=0)
    target_hidden_size: StrictInt | None = Count
    num_target_layers: StrictInt | None = Count
    dtype: Dtype | None = None
    torch_dtype: Dtype | None = None


class SpeculatorsFile(_DraftFields):
    transformer_layer_config: Body
    speculators_config: SpeculatorsSection
    aux_hidden_state_layer_ids: list[StrictInt] | None = None
    draft_vocab_size: StrictInt | None = Count
    sample_from_anchor: StrictBool | None = None
    sliding_window_non_causal: StrictBool | None = None


class DflashSection(_Lenient):
    target_layer_ids: list[StrictInt] | None = None
    mask_token_id: StrictInt | None = Field(default=None, ge=0)
    mask_token: StrictStr | None = None
    block_size: StrictInt | None = Count


class ZlabFile(Body, _DraftFields):
    """z-lab writes the draft body at the top level, beside its own `dflash_config`."""

    dflash_config: DflashSection | None = None
    target_layer_ids: list[StrictInt] | None = None
    target_model_name_or_path: StrictStr | None = None


def _field(loc: tuple) -> str:
    return ".".join(str(part) for part in loc) or "(the whole file)"


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def require_object(raw: Any, where: str) -> None:
    if not isinstance(raw, dict):
        kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(raw), "null")
        raise CheckpointError(f"{where}: holds a JSON {kind} ({_shown(raw)}), not an object; a drafter config.json "
                              "is one JSON object. Restore it or convert the drafter again")


def check(schema: type[BaseModel], raw: Any, where: str) -> None:
    """Raise CheckpointError naming `where`, the first bad field, its value and what it must be."""
    require_object(raw, where)
    try:
        schema.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        more = len(exc.errors()) - 1
        got = f" (got {_shown(err['input'])})" if err["type"] != "missing" else ""
        msg = re.sub(r" or instance of \w+", "", err["msg"])
        raise CheckpointError(f"{where}: field `{_field(err['loc'])}`: {msg[:1].lower() + msg[1:]}{got}"
                              + (f"; {more} more field(s) are wrong" if more > 0 else "")
                              + "; fix config.json or convert the drafter again") from None
