"""What a speculative-decoding run produces, step by step and prompt by prompt: the types the eval
loop (spec_decode.py) fills and the report (report.py) reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Step:
    committed: int  # tokens committed by this target forward (after truncation at EOS / limit)
    accepted: int  # leading draft slots accepted and kept (<= committed)
    position: int | None = None  # absolute position p of the block's first token (the last committed one)


@dataclass
class Generation:
    tokens: list[int]  # new tokens, prompt excluded
    seconds: float
    steps: list[Step] = field(default_factory=list)  # empty for plain decoding


@dataclass
class PromptResult:
    index: int
    prompt_tokens: int
    spec: Generation
    plain: Generation | None
    text: str = ""
    source: str | None = None  # the prompt's source label, if its data names one
