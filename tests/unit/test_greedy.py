"""The greedy token (dflash_train/greedy.py) is torch.argmax's, the first of tied maxima, in bf16 as in fp32: the feature
cache's greedy labels, the eval's verify steps and the HF regeneration take it, and the target's own greedy
decoding (`generate`, vLLM) takes argmax's."""

import copy

import pytest
import torch

from dflash_train.features.extract import head_outputs
from dflash_train.greedy import greedy_ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3000,), (64, 3000), (2, 5, 3000)])
def test_greedy_ids_equal_argmax_where_many_logits_tie(dtype, shape):
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 6, shape, generator=g).to(dtype)  # ~500 maxima tie in every row
    logits[..., -1] = 5  # and the last position is always one of them
    got = greedy_ids(logits)
    assert got.dtype == torch.long and got.shape == shape[:-1]
    assert torch.equal(got, logits.argmax(-1))
    assert torch.equal(got, (logits == 5).to(torch.int8).argmax(-1))  # the first 5 of each row


def test_a_bf16_heads_tied_rows_give_the_first_id(smollm2):
    """The target's head in bf16 with two rows made equal: where they lead, the cache's greedy label is the lower
    id, in a chunk of every position and in the masked rows' path alike."""
    model, _ = smollm2
    head = copy.deepcopy(model.get_output_embeddings()).to(torch.bfloat16)
    low, high = 1000, 30000
    final = torch.randn(2, 12, head.weight.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        head.weight[low] = head.weight[high] = final[0, 3] * 4  # the largest logit at position (0, 3)
    final = final.to(torch.bfloat16)
    logits = head(final)
    assert logits[0, 3, low] == logits[0, 3, high] == logits[0, 3].max()
    greedy, _, _ = head_outputs(head, final, chunk=5)
    assert greedy[0, 3] == low and torch.equal(greedy, logits.argmax(-1))
    where = torch.zeros(2, 12, dtype=torch.bool)
    where[0, 3] = where[1, 7] = True
    masked, _, _ = head_outputs(head, final, chunk=5, greedy=where)
    assert masked[0, 3] == low and masked[1, 7] == logits[1, 7].argmax() and int((masked >= 0).sum()) == 2
