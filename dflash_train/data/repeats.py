"""Where a token sequence repeats its own earlier text: the loops of a small target's greedy answers
("I'm not happy. I'm not happy. ..."), a list's repeated stem, a quoted line.

A block anchored at j repeats earlier text when the `n` tokens ending at j and the token after them occur
earlier in the sequence (prompt included): the context holds what the block should propose, and copying it
(prompt-lookup decoding) gets it right. The replay splits its acceptance there from elsewhere
(eval/replay.py); training can weigh those blocks up or down (`objective.repeat_weight`: the CPU demo's one-layer
drafter, which cannot copy, weighs them half).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

REPEAT_NGRAM = 3  # a 3-gram and the token after it seen before


def repeat_anchors(ids: Sequence[int], anchors: Sequence[int], block_size: int,
                   n: int = REPEAT_NGRAM) -> tuple[torch.Tensor, torch.Tensor]:
    """Which anchors a copy of earlier text follows, and what copying would accept there. At anchor j the
    `n` tokens ending at j and the token after them (ids[j - n + 1 : j + 2]) occur earlier in `ids`, prompt
    included: a block there repeats text the context holds (a loop of a greedy answer, a quoted line).
    Returns ([len(anchors)] bool, [len(anchors)] long): the flags, and at each flagged anchor the block length
    a copier gets (1 + the tokens after the `n` tokens' latest earlier occurrence that match ids[j + 1 :], at
    most block_size - 1 of them; prompt-lookup decoding's proposal), 0 elsewhere."""
    seen: set[tuple[int, ...]] = set()
    latest: dict[tuple[int, ...], int] = {}  # n tokens -> the end of their latest occurrence before j
    flags = torch.zeros(len(anchors), dtype=torch.bool)
    copied = torch.zeros(len(anchors), dtype=torch.long)
    where = {j: k for k, j in enumerate(anchors)}
    for j in range(n - 1, len(ids) - 1):
        gram, head = tuple(ids[j - n + 1: j + 2]), tuple(ids[j - n + 1: j + 1])
        if j in where and gram in seen:
            k, length = latest[head], 1
            while length < block_size and j + length < len(ids) and ids[k + length] == ids[j + length]:
                length += 1
            flags[where[j]], copied[where[j]] = True, length
        seen.add(gram)
        latest[head] = j
    return flags, copied
