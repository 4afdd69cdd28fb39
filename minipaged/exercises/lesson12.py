"""Lesson 12 exercises: verifying the draft tokens of speculative decoding.

    greedy_verify(target_argmax_ids, draft_token_ids) -> list[int]
        greedy verification: ``draft_token_ids`` holds the k tokens a proposer guessed,
        ``target_argmax_ids`` the k + 1 tokens the target model picks (its argmax) after the
        prompt plus each prefix of the drafts (position i: after the first i drafts). The
        tokens the step emits: the drafts up to the first one the target disagrees with, then
        the target's own token at that position (a correction), or, when every draft is right,
        the target's token after the last draft (a bonus). Always between 1 and k + 1 tokens.
    residual_distribution(p, q) -> tensor
        where the correction is drawn from after a rejection: max(0, p - q) token by token,
        divided by its sum, for two distributions ``p`` (target) and ``q`` (draft) over the same
        vocabulary (1-D float tensors that sum to 1, with q != p)

Expected answers: the package's ``minipaged.spec_decode.rejection_sampler.greedy_verify`` and
``residual_distribution`` on random cases.
"""
from __future__ import annotations

import torch

from minipaged.exercises import checking
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
from minipaged.spec_decode import rejection_sampler


@exercise
def check_greedy_verify(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("greedy_verify", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        k = rng.randint(1, 6)
        vocab = rng.choice([3, 5, 50])
        target = [rng.randrange(vocab) for _ in range(k + 1)]
        agree = rng.choice([0, k, rng.randint(0, k)])  # none, all, or some drafts right
        drafts = target[:agree] + [rng.randrange(vocab) for _ in range(k - agree)]
        expected = rejection_sampler.greedy_verify(list(target), list(drafts))
        got = learner(list(target), list(drafts))
        if isinstance(got, tuple):
            got = list(got)
        if got != expected:
            accepted = len(expected) - 1
            if isinstance(got, list) and got == expected[:-1]:
                hint = ("a verification step always emits one token more than it accepts: the "
                        "target's own token at the first disagreement, or the bonus after the "
                        "last draft when all are right")
            elif isinstance(got, list) and len(got) > len(expected):
                hint = ("stop at the first draft the target disagrees with: the drafts after it "
                        "were guessed after a wrong token")
            elif isinstance(got, list) and got[:accepted] == expected[:accepted]:
                hint = (f"the last token is the target's token at position {accepted} (after "
                        f"the {accepted} accepted drafts), not a draft")
            else:
                hint = ("compare draft i with the target's token at position i, the one it "
                        "picks after the same prefix")
            fail(learner.name, case, f"target_argmax_ids={target}, draft_token_ids={drafts}",
                 got, expected, hint)
    return passed(learner, num_cases)


def _random_distribution(rng, vocab: int, zeros: int) -> torch.Tensor:
    """A random distribution over ``vocab`` tokens, ``zeros`` of them with probability 0."""
    weights = [rng.random() + 0.05 for _ in range(vocab)]
    for i in rng.sample(range(vocab), zeros):
        weights[i] = 0.0
    t = torch.tensor(weights, dtype=torch.float32)  # (V,)
    return t / t.sum()


@exercise
def check_residual_distribution(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("residual_distribution", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        vocab = rng.randint(2, 10)
        p = _random_distribution(rng, vocab, rng.randint(0, vocab - 1) if case % 3 == 0 else 0)
        q = _random_distribution(rng, vocab, rng.randint(0, vocab - 1) if case % 4 == 0 else 0)
        if torch.allclose(p, q):
            continue
        expected = rejection_sampler.residual_distribution(p.clone(), q.clone())
        got = learner(p.clone(), q.clone())
        inputs = f"p={[round(v, 3) for v in p.tolist()]}, q={[round(v, 3) for v in q.tolist()]}"
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            fail(learner.name, case, inputs, got, f"a tensor of shape {tuple(expected.shape)}",
                 "the residual is a distribution over the same tokens as p and q")
        if not torch.allclose(got.float(), expected.float(), atol=1e-5):
            shown = [round(v, 3) for v in got.float().tolist()]
            want = [round(v, 3) for v in expected.float().tolist()]
            if bool((got < 0).any()):
                hint = ("tokens where the draft already gave more than the target (q > p) get "
                        "nothing: no probability is negative")
            elif abs(float(got.sum()) - 1.0) > 1e-4:
                hint = "a distribution sums to 1: divide by the sum of what is left"
            else:
                hint = ("only the part of p that q did not already cover is left: p - q where "
                        "that is positive")
            fail(learner.name, case, inputs, shown, want, hint)
    return passed(learner, num_cases)


def usable_greedy_verify(fn):
    """``fn`` once its check passed, else the package's ``greedy_verify``."""
    return checking.usable("greedy_verify", fn, rejection_sampler.greedy_verify)


def usable_residual(fn):
    """``fn`` once its check passed, else the package's ``residual_distribution``."""
    return checking.usable("residual_distribution", fn, rejection_sampler.residual_distribution)


__all__ = ["check_greedy_verify", "check_residual_distribution", "usable_greedy_verify",
           "usable_residual"]
