"""Temperature sampling: the accept/reject rule keeps the output distributed as the target's.

A Markov-chain target (next-token law P[token]) and a drafter whose every slot proposes a fixed
law r (the target head's row for MASK). Over many seeds, the first committed tokens must follow
the chain's exact marginals whatever r is, and slot 1 must be accepted with the exact
probability sum_j min(p_j, q_j).
"""

from __future__ import annotations

import pytest
import torch
from handbuilt_models import MASK, VOCAB, constant_drafter, markov_target

from dflash_train.eval.spec_decode import speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")

# chi-square 99.99% quantile for 5 degrees of freedom (6 tokens)
CHI2_5_DF = 25.74
RUNS = 700
PROMPT = [0, 1, 2]


def _chain(proposal: list[float]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    p = torch.zeros(VOCAB, VOCAB)
    p[:6, :6] = torch.rand(6, 6, generator=gen) + 0.15  # tokens 0..5; 6 and MASK never emitted
    p[6, 0] = 1.0
    p[MASK, :6] = torch.tensor(proposal)
    return p / p.sum(-1, keepdim=True)


def _tempered(p: torch.Tensor, temperature: float) -> torch.Tensor:
    t = p.pow(1.0 / temperature)
    return t / t.sum(-1, keepdim=True)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("proposal, temperature", [
    ([0.2, 0.15, 0.2, 0.15, 0.15, 0.15], 1.0),  # target-like: close to the chain's rows, mostly accepted
    ([0.9, 0.02, 0.02, 0.02, 0.02, 0.02], 0.7),  # far from them: many rejections and redraws
])
def test_committed_tokens_follow_the_target(proposal, temperature):
    probs = _chain(proposal)
    target = markov_target(probs)
    draft = constant_drafter(block_size=4).attach_target(target)
    p_t = _tempered(probs, temperature)
    q = p_t[MASK]  # the drafter's proposal law at this temperature
    y1 = torch.zeros(VOCAB)
    y2 = torch.zeros(VOCAB)
    slot1_accepted = 0
    for seed in range(RUNS):
        gen = torch.Generator().manual_seed(seed)
        out = speculative_generate(draft, target, PROMPT, 3, temperature=temperature, generator=gen)
        y1[out.tokens[1]] += 1
        y2[out.tokens[2]] += 1
        slot1_accepted += out.steps[0].accepted >= 1

    first = p_t[PROMPT[-1]]  # law of the prefill token
    assert _chi2(y1, first @ p_t) < CHI2_5_DF
    assert _chi2(y2, first @ p_t @ p_t) < CHI2_5_DF
    # slot 1 proposes from q after the prefill token y0: accepted w.p. E_y0 sum_j min(p(j|y0), q_j)
    rate = float((first[:, None] * torch.minimum(p_t, q[None])).sum())
    sigma = (rate * (1 - rate) / RUNS) ** 0.5
    assert abs(slot1_accepted / RUNS - rate) < 4.5 * sigma


def test_chi2_check_detects_a_wrong_law():
    """The statistic above has power: the drafter's own law r fails against the chain."""
    probs = _chain([0.9, 0.02, 0.02, 0.02, 0.02, 0.02])
    gen = torch.Generator().manual_seed(0)
    wrong = torch.bincount(torch.multinomial(probs[MASK], RUNS, replacement=True, generator=gen), minlength=VOCAB)
    assert _chi2(wrong.float(), probs[PROMPT[-1]] @ probs) > 10 * CHI2_5_DF
