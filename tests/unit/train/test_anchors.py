"""Anchor sampling and slot weights."""

import math

import pytest
import torch

from dflash_train.train.anchors import (
    anchor_budget,
    anchor_generator,
    gamma_for_block_size,
    sample_anchors,
    slot_weights,
)


def test_gamma_paper_values_and_rule():
    assert [gamma_for_block_size(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    assert gamma_for_block_size(4) == 2.0 and gamma_for_block_size(2) == 1.0
    assert gamma_for_block_size(12) == pytest.approx(5 + 2 / 3)
    w = slot_weights(8)
    assert w[0] == 0 and w[1] == 1 and w[3] == pytest.approx(math.exp(-2 / 4))


def test_anchors_need_two_masked_tokens_and_respect_budget():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 0, 1, 1], dtype=torch.bool)
    all_ = sample_anchors(mask, 100, anchor_generator(0, 0, 0))
    assert all_.tolist() == [1, 2, 7]
    few = sample_anchors(mask, 2, anchor_generator(0, 0, 0))
    assert few.numel() == 2 and set(few.tolist()) <= {1, 2, 7} and few.tolist() == sorted(few.tolist())


def test_anchor_budget_count_or_density_with_floor_and_cap():
    assert anchor_budget(100, 16) == 16 and anchor_budget(5, 16) == 5  # never more than the candidates
    assert anchor_budget(100, 16, (0.25, 4, 48)) == 25
    assert anchor_budget(10, 16, (0.25, 4, 48)) == 4  # the floor (ceil 2.5 = 3 < 4)
    assert anchor_budget(3, 16, (0.25, 4, 48)) == 3  # the floor, but only 3 candidates
    assert anchor_budget(400, 16, (0.25, 4, 48)) == 48  # the cap
    assert anchor_budget(400, 16, (0.25, 1, None)) == 100  # no cap
    assert anchor_budget(40, 16, (0.1, 1, None)) == 4  # exact products stay exact (no ceil(4.0000001) = 5)


def test_shared_prefix_length_is_the_template_every_row_starts_with():
    from dflash_train.train.anchors import shared_prefix_length

    rows = [[1, 2, 3, 9, 9], [1, 2, 3, 7], [1, 2, 3, 9]]
    assert shared_prefix_length(rows) == 3
    assert shared_prefix_length(rows + [[1, 5]]) == 1  # ... and no more
    assert shared_prefix_length([[4, 2], [5, 2]]) == 1  # position 0 has no context: never an anchor
    assert shared_prefix_length([[1, 2, 3]]) == 3
