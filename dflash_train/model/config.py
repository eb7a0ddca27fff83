"""The drafter's typed config. Field names are the speculators names (formats.md §3).

z-lab names (`target_layer_ids`, `dflash_config`) appear only in dflash_train/model/formats/zlab.py;
here the z-lab ids are a derived property (aux - 1).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflash_train.errors import ConfigError
from dflash_train.features.layer_ids import aux_to_target, default_target_layer_ids, target_to_aux

# rope keys a qwen3 body understands for any rope_type (yarn, llama3, dynamic, longrope, ...); the target's
# others describe its own attention (partial_rotary_factor, mrope_section) and do not carry over
# a block proposes block_size - 1 tokens a step; published drafters use 8-16, acceptance past ~16 is
# rare, and the training rows grow with B (anchors x B): a larger value is a typo, refused by name
MAX_BLOCK_SIZE = 64
_ROPE_KEYS = ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "attention_factor",
              "beta_fast", "beta_slow", "truncate", "mscale", "mscale_all_dim", "low_freq_factor",
              "high_freq_factor", "short_factor", "long_factor")


def drafter_rope(text_config) -> dict[str, Any]:
    """The drafter's rope parameters from the target's text config: its rope type with every parameter
    that type needs (yarn's factor and betas, llama3's frequency factors); for targets with per-layer-type
    rope (Gemma 3) the full-attention layers' entry."""
    rope = dict(getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):  # {"full_attention": {...}, "sliding_attention": ...}
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = rope.get("rope_theta") or getattr(text_config, "rope_theta", None) or 1_000_000.0
    kept = {k: v for k, v in rope.items() if k in _ROPE_KEYS}
    kept.update(rope_type=rope_type, rope_theta=float(theta))
    return kept


class DFlashConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # draft body: a Qwen3 decoder stack
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    rope_theta: float = 1_000_000.0
    rope_parameters: dict[str, Any] | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # vocabularies: vocab_size is the target's; draft_vocab_size < vocab_size means reduced
    vocab_size: int = Field(gt=0)
    draft_vocab_size: int = Field(gt=0)
    # the link to the target
    target_hidden_size: int = Field(gt=0)
    num_target_layers: int | None = None
    aux_hidden_state_layer_ids: list[int]
    block_size: int = Field(ge=2, le=MAX_BLOCK_SIZE)
    mask_token_id: int = Field(ge=0)
    sample_from_anchor: bool = False
    sliding_window_non_causal: bool = True
    verifier_name_or_path: str | None = None
    verifier_architectures: list[str] | None = None
    dtype: str = "bfloat16"

    @model_validator(mode="after")
    def _check(self) -> DFlashConfig:
        if not self.aux_hidden_state_layer_ids:
            raise ValueError("aux_hidden_state_layer_ids must name at least one layer")
        if any(k < 1 for k in self.aux_hidden_state_layer_ids):
            raise ValueError("aux_hidden_state_layer_ids are HF hidden_states indices of decoder "
                             "outputs and must be >= 1 (aux = z-lab target layer id + 1)")
        if self.num_target_layers is not None and max(self.aux_hidden_state_layer_ids) > self.num_target_layers:
            raise ValueError(f"aux_hidden_state_layer_ids {self.aux_hidden_state_layer_ids} reach past the "
                             f"target's {self.num_target_layers} layers")
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the target vocab "
                             f"(vocab_size {self.vocab_size})")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        return self

    @classmethod
    def build(cls, where: str, error: type[Exception] = ConfigError, **fields) -> DFlashConfig:
        """Validate fields; a failure becomes `error` with one readable line naming `where` and the field."""
        try:
            return cls(**fields)
        except ValidationError as exc:
            problems = []
            for e in exc.errors():
                loc = ".".join(str(x) for x in e["loc"])
                msg = e["msg"].removeprefix("Value error, ")
                problems.append(f"{loc}: {msg}" if loc else msg)
            raise error(f"{where}: " + "; ".join(problems)) from None

    # derived values -------------------------------------------------------------------------
    @property
    def target_layer_ids(self) -> list[int]:
        """z-lab ids (decoder-layer outputs), as the feature extractor wants them."""
        return aux_to_target(self.aux_hidden_state_layer_ids)

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_hidden_state_layer_ids)

    @property
    def num_speculative_tokens(self) -> int:
        return self.block_size - 1

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size < self.vocab_size

    @property
    def rope(self) -> dict[str, Any]:
        return self.rope_parameters or {"rope_type": "default", "rope_theta": self.rope_theta}

    @property
    def num_parameters(self) -> int:
        """The drafter's trainable-or-saved weights (its state_dict, buffers aside), counted from the config."""
        h, d, q, kv = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        attention = h * d * (2 * q + 2 * kv) + (d * (2 * q + 2 * kv) if self.attention_bias else 0) + 2 * d
        per_layer = attention + 3 * h * self.intermediate_size + 2 * h
        lm_head = self.draft_vocab_size * h if self.reduced_vocab else 0
        return self.num_hidden_layers * per_layer + self.num_aux_layers * self.target_hidden_size * h + 2 * h + lm_head

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    @property
    def all_full_attention(self) -> bool:
        return all(self.layer_type(i) == "full_attention" for i in range(self.num_hidden_layers))

    # construction ---------------------------------------------------------------------------
    @classmethod
    def for_target(cls, target_config, *, num_hidden_layers: int = 1, block_size: int = 16,
                   mask_token_id: int, target_layer_ids: list[int] | None = None,
                   num_features: int = 5, draft_vocab_size: int | None = None,
                   intermediate_size: int | None = None, verifier_name_or_path: str | None = None,
                   dtype: str = "bfloat16") -> DFlashConfig:
        """A drafter shaped like the target's layers (draft hidden == target hidden)."""
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        num_target = tc.num_hidden_layers
        ids = list(target_layer_ids) if target_layer_ids else default_target_layer_ids(num_target, num_features)
        heads = tc.num_attention_heads
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
        rope = drafter_rope(tc)
        rope_theta = rope["rope_theta"]
        return cls.build(
            "drafter config for this target",
            hidden_size=tc.hidden_size,
            intermediate_size=intermediate_size or tc.intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            hidden_act=getattr(tc, "hidden_act", "silu"),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
            rope_theta=rope_theta,
            rope_parameters=rope,
            vocab_size=tc.vocab_size,
            draft_vocab_size=draft_vocab_size or tc.vocab_size,
            target_hidden_size=tc.hidden_size,
            num_target_layers=num_target,
            aux_hidden_state_layer_ids=target_to_aux(ids),
            block_size=block_size,
            mask_token_id=mask_token_id,
            verifier_name_or_path=verifier_name_or_path,
            verifier_architectures=list(getattr(target_config, "architectures", None) or []) or None,
            dtype=dtype,
        )

    def check_against_target(self, target_config, where: str = "drafter config") -> None:
        """Raise ConfigError naming the field when this drafter cannot run on the target."""
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        if self.target_hidden_size != tc.hidden_size:
            raise ConfigError(f"{where}: target_hidden_size {self.target_hidden_size} differs from the "
                              f"target's hidden_size {tc.hidden_size}; this drafter was trained for another target")
        if self.vocab_size != tc.vocab_size:
            raise ConfigError(f"{where}: vocab_size {self.vocab_size} differs from the target's {tc.vocab_size}")
        if max(self.aux_hidden_state_layer_ids) > tc.num_hidden_layers:
            raise ConfigError(f"{where}: aux_hidden_state_layer_ids {self.aux_hidden_state_layer_ids} reach past "
                              f"the target's {tc.num_hidden_layers} layers")
        if self.mask_token_id >= tc.vocab_size:
            raise ConfigError(f"{where}: mask_token_id {self.mask_token_id} is outside the target vocab {tc.vocab_size}")
