"""Fixtures of the decoding tests: chat prompts whose greedy answers on the real SmolLM2 stop at different steps
(test_hf_generate.py has its own, shorter answers)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def prompts(smollm2):
    from dflash_train.data.render import ChatRenderer

    renderer = ChatRenderer(smollm2[1], max_length=256)
    questions = ["Say hi.", "Reply with one word: yes or no?", "Name a fruit.",
                 "Why is the sky blue? Answer in one short sentence that a child would understand, please."]
    return [renderer.prompt_ids([{"role": "user", "content": q}]) for q in questions]
