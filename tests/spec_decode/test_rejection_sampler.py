"""The rejection sampler of speculative decoding keeps the target's distribution exactly
(lesson 12).

A chi-square test against the analytic distribution on a small vocabulary, with a fixed seed (so
the test is deterministic) and a threshold far below any honest p-value (so a different seed would
not make it flaky): a sampler that ignored ``q``, or drew the correction from ``p``, fails it.
"""
from __future__ import annotations

import pytest
import torch

from minipaged.spec_decode.rejection_sampler import (greedy_verify, rejection_sample,
                                                     residual_distribution)

pytestmark = pytest.mark.lesson12


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of observed ``counts`` (V,) against ``probs`` (V,) (cells with p = 0 must be 0)."""
    assert counts[probs == 0].sum() == 0, "a token the target never gives was emitted"
    keep = probs > 0
    expected = probs[keep].double() * counts.sum()
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def random_probs(generator: torch.Generator, rows: int, vocab: int, zeros: bool = True):
    probs = torch.rand(rows, vocab, generator=generator, dtype=torch.float64) ** 2
    if zeros:
        probs[:, 0] = 0.0  # a token the target never gives
    return probs / probs.sum(-1, keepdim=True)  # (rows, V)


@pytest.mark.parametrize("vocab,k,deterministic", [(5, 1, False), (6, 3, False), (8, 2, True)])
def test_emitted_tokens_follow_the_target_distribution(vocab, k, deterministic):
    g = torch.Generator().manual_seed(1234 + vocab)
    target = random_probs(g, k + 1, vocab)  # the target ignores the prefix: rows are analytic
    draft = random_probs(g, k, vocab, zeros=False)
    fixed_draft = [int(torch.argmax(target[i])) for i in range(k)]  # an n-gram-like proposer
    samples = 8000
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)  # the token after an accepted first draft
    bonus = torch.zeros(vocab)  # the token after all k accepted drafts
    for _ in range(samples):
        if deterministic:
            proposed, q = fixed_draft, None
        else:
            proposed = [int(torch.multinomial(draft[i], 1, generator=g)) for i in range(k)]
            q = draft
        out = rejection_sample(target, proposed, q, g)
        assert 1 <= len(out) <= k + 1 and out[:len(out) - 1] == proposed[:len(out) - 1]
        first[out[0]] += 1
        if len(out) >= 2:
            second[out[1]] += 1
        if len(out) == k + 1:
            bonus[out[k]] += 1
    assert chi_square_p_value(first, target[0]) > 1e-4
    assert chi_square_p_value(second, target[1]) > 1e-4
    assert chi_square_p_value(bonus, target[k]) > 1e-4


def test_a_sampler_that_ignores_q_fails_the_same_test():
    """The test has power: accepting every draft (as if p == q) is caught."""
    g = torch.Generator().manual_seed(7)
    target = random_probs(g, 2, 6)
    draft = random_probs(g, 1, 6, zeros=False)
    counts = torch.zeros(6)
    for _ in range(5000):
        counts[int(torch.multinomial(draft[0], 1, generator=g))] += 1
    with pytest.raises(AssertionError):
        assert chi_square_p_value(counts, target[0]) > 1e-4


def test_seeded_draws_repeat_and_the_draft_equal_to_the_target_is_always_accepted():
    g = torch.Generator().manual_seed(3)
    target = random_probs(g, 4, 7)
    proposed = [2, 3, 4]
    a = rejection_sample(target, proposed, None, torch.Generator().manual_seed(11))
    b = rejection_sample(target, proposed, None, torch.Generator().manual_seed(11))
    assert a == b
    # q == p: every draft is accepted, so k + 1 tokens come out
    for seed in range(20):
        out = rejection_sample(target, proposed, target[:3], torch.Generator().manual_seed(seed))
        assert len(out) == 4 and out[:3] == proposed


def test_greedy_verify_and_residual():
    assert greedy_verify([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert greedy_verify([5, 9, 7], [5, 6]) == [5, 9]
    assert greedy_verify([4], []) == [4]
    with pytest.raises(ValueError, match="target_argmax_ids"):
        greedy_verify([1], [1, 2])
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(residual_distribution(p, p), p)  # documented edge case
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(torch.ones(2, 3) / 3, [0, 1], None, None)
