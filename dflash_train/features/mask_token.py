"""Choosing and checking the mask token: an embedding row that never occurs in real text.

Qwen3-style targets have spare embedding rows past the tokenizer (`len(tokenizer)` is then
the mask id, as z-lab uses 151669). Targets without spare rows (SmolLM2, Llama 3) use a
special token that the chat template never emits.
"""

from __future__ import annotations

from dflash_train.errors import ConfigError

_PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
          {"role": "assistant", "content": "a"}]


def _template_ids(tokenizer) -> set[int]:
    """Token ids the tokenizer itself emits: bos/eos/pad/unk and whatever the chat template renders."""
    ids = {i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
                       tokenizer.unk_token_id) if i is not None}
    if getattr(tokenizer, "chat_template", None):
        try:
            ids |= set(tokenizer.apply_chat_template(_PROBE, tokenize=True, return_dict=False))
        except Exception:  # a template that needs other roles: the special tokens above still count
            pass
    return ids


def default_mask_token_id(tokenizer, embedding_rows: int) -> int:
    """Spare row `len(tokenizer)` when the embedding has one, else an unused special token."""
    if embedding_rows > len(tokenizer):
        return len(tokenizer)
    used = _template_ids(tokenizer)
    candidates = sorted(i for i, tok in tokenizer.added_tokens_decoder.items()
                        if tok.special and i not in used and i < embedding_rows)
    if not candidates:
        raise ConfigError("target has no spare embedding row and no unused special token for the mask; "
                          "set mask_token_id to a token that never occurs in your data")
    return candidates[-1]


def check_mask_token_id(mask_token_id: int, tokenizer, embedding_rows: int, field: str = "mask_token_id") -> None:
    """Raise ConfigError naming `field` when the id is outside the embedding or used for real text."""
    if not 0 <= mask_token_id < embedding_rows:
        raise ConfigError(f"{field}: {mask_token_id} is outside the target's embedding rows 0..{embedding_rows - 1}")
    if mask_token_id >= len(tokenizer):
        return  # a spare row: the tokenizer never produces it
    special = tokenizer.added_tokens_decoder.get(mask_token_id)
    if special is None or not special.special:
        raise ConfigError(f"{field}: {mask_token_id} ({tokenizer.convert_ids_to_tokens(mask_token_id)!r}) is an "
                          "ordinary token the tokenizer uses for real text; pick a spare row "
                          f"(>= {len(tokenizer)}) or an unused special token")
    if mask_token_id in _template_ids(tokenizer):
        raise ConfigError(f"{field}: {mask_token_id} ({special.content!r}) is emitted by the chat template "
                          "or is bos/eos/pad; pick an unused special token")
