"""The target architectures the toolkit trains drafters for, and which engines serve DFlash for them.

One registry, keyed by the HF text-config `model_type` (`config.get_text_config().model_type`):
the tests' target matrix, `target-info`, `validate` and docs/targets.md all read it.

Serve facts (checked against engine code, late 2026):
- vLLM serves a DFlash drafter only for targets whose model class implements its EAGLE-3 aux
  hidden-state interface (`SupportsEagle3`). Checked with `supports_eagle3()` on vLLM 0.32's CPU
  build (llama, mistral, qwen2, qwen3, qwen3_moe, qwen3_next, gpt_oss, gemma4, deepseek_v2/v3,
  kimi_k25, minimax_m2, granite: yes; gemma3: no) and in qwen3_5.py's class bases (yes).
- SGLang serves DFlash for targets whose model sets `set_dflash_layers_to_capture`; seen in its
  qwen3, qwen3_moe, qwen3_next and qwen3_5 models. None means not checked: try it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_train.errors import ConfigError


@dataclass(frozen=True)
class Architecture:
    model_type: str  # the HF text config's model_type
    kind: str  # dense, MoE, hybrid (linear-attention layers), sliding window, MLA
    vllm: bool  # vLLM's model class implements SupportsEagle3 (DFlash servable)
    sglang: bool | None  # SGLang's model captures DFlash layers; None: not checked
    note: str = ""
    classes: tuple[str, ...] = ()  # HF `architectures` names of checkpoints with this text model


_ALL = [
    Architecture("llama", "dense", True, None, "Llama 3.x, SmolLM2", ("LlamaForCausalLM",)),
    Architecture("mistral", "dense", True, None, "vLLM serves it through its Llama class", ("MistralForCausalLM",)),
    Architecture("qwen2", "dense", True, None, "Qwen2.5", ("Qwen2ForCausalLM",)),
    Architecture("qwen3", "dense", True, True, "", ("Qwen3ForCausalLM",)),
    Architecture("qwen3_moe", "MoE", True, True, "Qwen3-Coder-30B-A3B", ("Qwen3MoeForCausalLM",)),
    Architecture("qwen3_next", "hybrid MoE (Gated DeltaNet + full attention)", True, True, "",
                 ("Qwen3NextForCausalLM",)),
    Architecture("qwen3_5_text", "hybrid (Gated DeltaNet + full attention)", True, True, "Qwen3.5 / 3.6",
                 ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")),
    Architecture("qwen3_5_moe_text", "hybrid MoE (Gated DeltaNet + full attention)", True, True, "Qwen3.5 MoE",
                 ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")),
    Architecture("gpt_oss", "MoE, sliding window, yarn rope", True, None, "harmony chat format",
                 ("GptOssForCausalLM",)),
    Architecture("gemma3_text", "dense, sliding window", False, None,
                 "vLLM's Gemma 3 lacks the EAGLE-3 interface (Gemma 4 has it)",
                 ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")),
    Architecture("deepseek_v3", "MoE, MLA", True, None, "DeepSeek-V3; Kimi-K2.5's text model",
                 ("DeepseekV3ForCausalLM",)),
    Architecture("minimax_m2", "MoE", True, None, "", ("MiniMaxM2ForCausalLM",)),
]
ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in _ALL}


def text_model_type(config) -> str:
    """The model_type of a target config's text model (a VLM's language model, else the config's own)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))


def architecture(config) -> Architecture:
    """The registry entry of a target config; a ConfigError naming the architecture and the supported
    ones when the toolkit has not been checked on it (features mean the same thing only where tested)."""
    model_type = text_model_type(config)
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    raise ConfigError(f"--target: architecture {model_type!r} is not one the toolkit extracts features from; "
                      f"supported: {', '.join(sorted(ARCHITECTURES))}")


def by_class_names(names) -> Architecture | None:
    """The registry entry for a checkpoint's HF `architectures` list (a drafter's verifier), or None."""
    for arch in _ALL:
        if set(names or ()) & set(arch.classes):
            return arch
    return None


def serve_line(arch: Architecture) -> str:
    """One line saying which engines serve DFlash drafters for this architecture."""
    sglang = {True: "yes", False: "no", None: "not checked"}[arch.sglang]
    vllm = "yes" if arch.vllm else "no (no EAGLE-3 aux hidden-state interface)"
    return f"vLLM serves DFlash: {vllm}; SGLang serves DFlash: {sglang}"
