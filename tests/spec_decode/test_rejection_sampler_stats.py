"""Rejection sampling emits exactly the target distribution: chi-square tests (lesson 12).

``rejection_sample`` accepts a draft token x with probability min(1, p(x) / q(x)) and, at the first
rejection, samples a correction from the residual max(0, p - q) (normalised); when all k drafts
are accepted it adds a bonus token from the last target row. With fixed target rows p_0 .. p_k
and draft rows q_1 .. q_k, the probability of each emitted sequence is known in closed form:

    x_1 .. x_j accepted, then z:  prod_{i<=j} min(p_{i-1}(x_i), q_i(x_i))
                                  * (max(0, p_j(z) - q_{j+1}(z))   if j < k: a correction
                                     p_k(z)                          if j = k: the bonus)

(the drafts are drawn from q, so q(x) * min(1, p(x)/q(x)) = min(p(x), q(x))). In particular the
first emitted token is distributed as p_0, whatever q is. Each test draws tens of thousands of
samples (10,000 to 30,000) with a fixed seed and compares the counts with that law by Pearson's chi-square
(bins with an expected count under 5 are pooled; an outcome of probability 0 must never occur).
The threshold is a p-value of 1e-3 (fixed seeds: the test is deterministic), and a negative
control shows the same test rejects a sampler that draws its correction from p instead of from
the residual. Run with ``-s`` to see the statistics.

Slow (left out of `make test`): three of the chi-square tests, about 26 s together on the 2-core
machine (measured at load ~15); the others stay in the fast tier.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from minipaged.spec_decode import rejection_sampler as rs

pytestmark = pytest.mark.lesson12

P_VALUE_FLOOR = 1e-3  # a correct sampler passes with this margin (the seeds are fixed)
P_VALUE_WRONG = 1e-9  # the wrong sampler of the negative control lands far below this


def chi_square(counts: dict, law: dict, n: int, min_expected: float = 5.0):
    """Pearson's chi-square of ``counts`` (outcome -> count, out of ``n``) against ``law``
    (outcome -> probability); returns (statistic, degrees of freedom, p-value, the outcomes of
    probability 0 that occurred, with their counts)."""
    impossible = {o: c for o, c in counts.items() if law.get(o, 0.0) <= 0.0}
    assert abs(sum(law.values()) - 1.0) < 1e-5, sum(law.values())
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for outcome, prob in law.items():
        if prob <= 0.0:
            continue
        if prob * n < min_expected:
            pooled_o += counts.get(outcome, 0)
            pooled_e += prob * n
        else:
            observed.append(counts.get(outcome, 0))
            expected.append(prob * n)
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    o = torch.tensor(observed, dtype=torch.float64)
    e = torch.tensor(expected, dtype=torch.float64)
    stat = float(((o - e) ** 2 / e).sum())
    df = len(observed) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p_value, impossible


def emitted_law(p: torch.Tensor, q: torch.Tensor | None, drafts_fixed=None) -> dict:
    """The exact law of the emitted sequence (a tuple of token ids).

    Args:
        p: (k+1, V) target rows. q: (k, V) draft rows the drafts are drawn from, or None with
        ``drafts_fixed`` (k token ids) for a deterministic proposer (q one-hot on them).
    """
    k, V = p.shape[0] - 1, p.shape[1]
    if q is None:
        q = torch.zeros(k, V, dtype=torch.float64)
        q[torch.arange(k), torch.tensor(drafts_fixed)] = 1.0
    p, q = p.double(), q.double()
    law: dict[tuple, float] = {}
    accept = torch.minimum(p[:k], q)  # (k, V): P(draft x_i = x and accepted)
    residual = torch.clamp(p[:k] - q, min=0.0)  # (k, V): unnormalised, mass = P(rejection)
    for j in range(k + 1):
        for prefix in itertools.product(range(V), repeat=j):
            weight = 1.0
            for i, x in enumerate(prefix):
                weight *= float(accept[i, x])
            if weight == 0.0:
                continue
            last = p[k] if j == k else residual[j]
            for z in range(V):
                if float(last[z]) > 0.0:
                    law[prefix + (z,)] = weight * float(last[z])
    return law


def draw(p, q, n, seed, drafts_fixed=None, sampler=None):
    """``n`` calls of the sampler; returns outcome -> count."""
    sampler = sampler or rs.rejection_sample
    gen = torch.Generator().manual_seed(seed)
    k = p.shape[0] - 1
    if q is None:
        drafts = torch.tensor([drafts_fixed] * n)  # (n, k)
    else:  # the drafts, drawn from q row by row, all at once: (n, k)
        drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen)
                              for i in range(k)], dim=1)
    counts: dict[tuple, int] = {}
    for row in drafts.tolist():
        out = tuple(sampler(p, row, q, gen))
        counts[out] = counts.get(out, 0) + 1
    return counts


def first_token(counts: dict) -> dict:
    firsts: dict[tuple, int] = {}
    for seq, c in counts.items():
        firsts[(seq[0],)] = firsts.get((seq[0],), 0) + c
    return firsts


def rows(*values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum(dim=-1, keepdim=True)


def report(name, stat, df, p_value, impossible):
    print(f"\n{name}: chi-square {stat:.2f} with {df} degrees of freedom, p-value {p_value:.3g}"
          + (f"; outcomes of probability 0 emitted: {impossible}" if impossible else ""))


def check(name, counts, law, n):
    stat, df, p_value, impossible = chi_square(counts, law, n)
    report(name, stat, df, p_value, impossible)
    assert not impossible, f"{name}: outcomes of probability 0 were emitted: {impossible}"
    assert p_value > P_VALUE_FLOOR, f"{name}: the emitted tokens do not follow the target law"
    return p_value


# Six tokens; q prefers other tokens than p, so there are rejections of every kind.
P_K1 = rows([0.30, 0.25, 0.20, 0.12, 0.08, 0.05],
            [0.10, 0.15, 0.40, 0.05, 0.20, 0.10])
Q_K1 = rows([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])


@pytest.mark.slow
def test_k1_the_whole_emitted_sequence_follows_the_exact_law():
    n = 30_000
    counts = draw(P_K1, Q_K1, n, seed=1)
    check("k=1, q != p: emitted sequences", counts, emitted_law(P_K1, Q_K1), n)
    check("k=1, q != p: first token vs p_0", first_token(counts),
          {(z,): float(P_K1[0, z]) for z in range(6)}, n)


@pytest.mark.slow
def test_k3_first_token_is_p0_and_the_sequences_follow_the_exact_law():
    n = 25_000
    g = torch.Generator().manual_seed(7)
    V = 5
    p = torch.softmax(torch.randn(4, V, generator=g) * 1.2, dim=-1)  # (k+1, V)
    q = torch.softmax(torch.randn(3, V, generator=g) * 1.2, dim=-1)  # (k, V)
    counts = draw(p, q, n, seed=2)
    check("k=3, q != p: first token vs p_0", first_token(counts),
          {(z,): float(p[0, z]) for z in range(V)}, n)
    check("k=3, q != p: emitted sequences", counts, emitted_law(p, q), n)
    lengths = {}
    for seq, c in counts.items():
        lengths[len(seq)] = lengths.get(len(seq), 0) + c
    assert set(lengths) == {1, 2, 3, 4}, lengths  # every number of accepted drafts happens


@pytest.mark.slow
def test_deterministic_draft_q_is_one_hot():
    """draft_probs=None: the proposer's token x is accepted with probability p(x), the correction
    comes from p with x removed."""
    n = 10_000
    for drafts in ([2], [4], [0, 2, 1]):
        k = len(drafts)
        p = torch.cat([P_K1, rows([0.2, 0.2, 0.2, 0.2, 0.1, 0.1]),
                       rows([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])])[:k + 1]
        counts = draw(p, None, n, seed=3 + k, drafts_fixed=drafts)
        check(f"deterministic drafts {drafts}: emitted sequences", counts,
              emitted_law(p, None, drafts), n)
        check(f"deterministic drafts {drafts}: first token vs p_0", first_token(counts),
              {(z,): float(p[0, z]) for z in range(6)}, n)


def test_zeros_in_q_where_p_is_not_and_in_p_where_q_is_not():
    """Tokens q never proposes still come out (through the residual); tokens p forbids are always
    rejected and never emitted."""
    n = 20_000
    p = torch.tensor([[0.35, 0.30, 0.20, 0.15, 0.0, 0.0, 0.0],
                      [0.0, 0.25, 0.25, 0.0, 0.25, 0.25, 0.0]])
    q = torch.tensor([[0.0, 0.10, 0.40, 0.0, 0.30, 0.10, 0.10]])
    counts = draw(p, q, n, seed=4)
    check("zeros in p and q: emitted sequences", counts, emitted_law(p, q), n)
    check("zeros in p and q: first token vs p_0", first_token(counts),
          {(z,): float(p[0, z]) for z in range(7)}, n)
    assert counts.get((0,), 0) > 0 and counts.get((3,), 0) > 0  # never proposed, still emitted


def wrong_rejection_sample(target_probs, draft_token_ids, draft_probs, generator):
    """The negative control: the package's sampler with the correction drawn from p, not from
    the residual max(0, p - q)."""
    original = rs.residual_distribution
    rs.residual_distribution = lambda p, q: p
    try:
        return rs.rejection_sample(target_probs, draft_token_ids, draft_probs, generator)
    finally:
        rs.residual_distribution = original


def test_the_test_catches_a_correction_drawn_from_p_instead_of_the_residual():
    n = 20_000
    counts = draw(P_K1, Q_K1, n, seed=1, sampler=wrong_rejection_sample)
    stat, df, p_value, impossible = chi_square(counts, emitted_law(P_K1, Q_K1), n)
    report("negative control (correction from p): emitted sequences", stat, df, p_value,
           impossible)
    assert impossible  # corrections where p <= q: never possible with the residual
    # The first token's marginal alone (no outcome of it is impossible): the chi-square catches it.
    stat, df, p_value, impossible = chi_square(first_token(counts),
                                               {(z,): float(P_K1[0, z]) for z in range(6)}, n)
    report("negative control (correction from p): first token vs p_0", stat, df, p_value,
           impossible)
    assert not impossible and p_value < P_VALUE_WRONG
