"""Rendering conversations with the target's own chat template, and assistant loss masks.

The loss mask covers exactly what the target would generate in each assistant turn: the
turn's text plus its end-of-turn token (e.g. `<|im_end|>`, `<|eot_id|>`), never the role
header the template writes before it nor separators after it.

Two ways to find those spans:
- templates with `{% generation %}` markers: transformers' `return_assistant_tokens_mask`;
- all others: render prefixes. For assistant turn i, the turn starts where the full render
  and `render(messages[:i], add_generation_prompt=True)` stop agreeing (so text the template
  puts into the generation prompt, like Qwen3's empty think block with thinking off, stays
  unsupervised) and ends after the first end-of-turn marker that follows. The marker is found
  once per template by rendering probe conversations; a template may end the conversation's last
  turn differently from earlier ones (harmony / gpt-oss: `<|return|>` after the final answer,
  `<|end|>` after earlier turns and after the last turn's analysis-channel reasoning, which the
  model generates in the same turn), so each kind of turn gets its own marker.
Token spans come from character spans through the tokenizer's offset mapping.

Qwen3-style templates drop the reasoning of earlier assistant turns from the history: only
the last turn of a rendered conversation keeps its `<think>` block, as when served.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dflash_train.errors import DataError

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
_PROBE = "Zq7xPROBEx7qZ"

DROP_NO_ASSISTANT = "no_assistant_turn"
DROP_NO_SUPERVISED = "no_supervised_tokens_after_truncation"
DROP_EMPTY = "empty_conversation"


@dataclass
class RenderedRow:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool
    tokens_cut: int = 0  # tokens past max_length that the row lost


def check_chat_template(tokenizer, where: str = "--target") -> None:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "?")
        raise DataError(f"{where} {name}: the tokenizer has no chat template; pick an instruct/chat target or add "
                        "`chat_template` to its tokenizer_config.json (or a chat_template.jinja file)")


def uses_generation_markers(tokenizer) -> bool:
    return bool(_GENERATION_TAG.search(tokenizer.chat_template or ""))


class ChatRenderer:
    """Renders normalised conversations into (input_ids, loss_mask) for one tokenizer."""

    def __init__(self, tokenizer, max_length: int = 2048, thinking: bool | None = None):
        check_chat_template(tokenizer)
        if max_length < 2:
            raise DataError(f"--max-length must be >= 2, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.thinking = thinking
        self.markers = uses_generation_markers(tokenizer)
        self._eot = None if self.markers else self._end_of_turn_marker(last=False)
        self._eot_last = None if self.markers else self._end_of_turn_marker(last=True)

    # -- template calls ------------------------------------------------------------------
    def _kwargs(self) -> dict:
        return {} if self.thinking is None else {"enable_thinking": bool(self.thinking)}

    def text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **self._kwargs())
        except Exception as exc:  # jinja raise_exception(...) for unsupported role orders
            raise DataError(f"chat template rejected the conversation ({exc})") from exc

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of the conversation so far plus the generation prompt (for regeneration)."""
        return self._encode(self.text(messages, add_generation_prompt=True))[0]

    def _encode(self, text: str):
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def _end_of_turn_marker(self, last: bool) -> str:
        """What ends an assistant turn: the conversation's last message (`last`) or one followed by more."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        if not last:
            probe += [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"}]
        text = self.text(probe)
        at = text.find(_PROBE)
        if at < 0:
            raise DataError("the chat template does not render assistant content verbatim; "
                            "add {% generation %} markers to it")
        marker = text[at + len(_PROBE):].strip()
        if not marker:
            raise DataError("the chat template writes no end-of-turn text after an assistant message; "
                            "add {% generation %} markers to it")
        # a template may write several things after the content; the first special token ends the turn
        specials = sorted((s for s in self.tokenizer.all_special_tokens + list(self.tokenizer.get_added_vocab())
                           if s and marker.startswith(s)), key=len, reverse=True)
        return specials[0] if specials else marker

    # -- spans ---------------------------------------------------------------------------
    def char_spans(self, messages: list[dict], full: str) -> list[tuple[int, int]]:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.text(messages[:i], add_generation_prompt=True)
            start = _common_prefix(prompt, full)
            # never before the end of the previous message
            start = max(start, spans[-1][1] if spans else 0)
            eot = self._eot_last if i == len(messages) - 1 else self._eot
            end = full.find(eot, start)
            if end < 0:
                raise DataError(f"cannot find the end-of-turn marker {eot!r} after assistant turn {i}")
            spans.append((start, end + len(eot)))
        return spans

    def render(self, messages: list[dict]) -> RenderedRow | str:
        """A RenderedRow, or the reason (a DROP_* string) the conversation is skipped."""
        if not messages:
            return DROP_EMPTY
        if not any(m["role"] == "assistant" for m in messages):
            return DROP_NO_ASSISTANT
        if self.markers:
            try:
                enc = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                         return_assistant_tokens_mask=True, **self._kwargs())
            except Exception as exc:
                raise DataError(f"chat template rejected the conversation ({exc})") from exc
            ids, mask = list(enc["input_ids"]), [int(x) for x in enc["assistant_masks"]]
        else:
            full = self.text(messages)
            ids, offsets = self._encode(full)
            spans = self.char_spans(messages, full)
            mask = [0] * len(ids)
            k = 0
            for t, (a, b) in enumerate(offsets):
                while k < len(spans) and spans[k][1] <= a:
                    k += 1
                if k < len(spans) and b > spans[k][0] and a < spans[k][1] and b > a:
                    mask[t] = 1
        cut = max(0, len(ids) - self.max_length)
        ids, mask = ids[: self.max_length], mask[: self.max_length]
        if not any(mask):
            return DROP_NO_SUPERVISED
        return RenderedRow(ids, mask, cut > 0, cut)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the longest equal prefix
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
