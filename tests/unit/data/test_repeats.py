"""Where a sequence repeats its earlier text (dflash_train/data/repeats.py): the flags the replay splits its
acceptance by and training weighs blocks by, and what copying the earlier text would accept."""

from __future__ import annotations

from dflash_train.data.repeats import repeat_anchors


def test_an_anchor_repeats_earlier_text_when_its_3_gram_and_next_token_were_seen():
    # a loop of period 4 after a prompt: 5 6 7 | 1 2 3 4 1 2 3 4 1 2
    ids = [5, 6, 7, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    anchors = list(range(3, len(ids) - 1))  # every answer token with a successor
    flags, copied = repeat_anchors(ids, anchors, block_size=4)
    # anchor j repeats when ids[j-2 : j+2] occurred before: from the second lap's third token (j = 9: 1 2 3 -> 4)
    assert flags.tolist() == [j >= 9 for j in anchors]
    # copying the first lap: at j = 9 the 3 tokens after "1 2 3" were "4 1 2", all right (a block of 4); at
    # j = 11 only "3" is left before the end (1 + 1); unflagged anchors get 0
    assert copied.tolist() == [0] * 6 + [4, 3, 2, 0][:len(anchors) - 6] and copied[anchors.index(11)] == 2
    # the same 3 tokens followed by another token is not a copy; the prompt's text counts as earlier text
    assert repeat_anchors([1, 2, 3, 9, 1, 2, 3, 8], [6], 4)[0].tolist() == [False]
    flags, copied = repeat_anchors([1, 2, 3, 9, 5, 1, 2, 3, 9, 6], [7], 4)
    assert flags.tolist() == [True] and copied.tolist() == [2]  # "9" copied, then "5" against "6"
    # the latest occurrence is the one copied
    assert repeat_anchors([1, 2, 3, 9, 7, 1, 2, 3, 9, 8, 1, 2, 3, 9, 8], [12], 4)[1].tolist() == [3]
    assert repeat_anchors([1, 2], [0], 4)[0].tolist() == [False]  # too short for a 3-gram
