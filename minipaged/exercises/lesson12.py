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

The build track's components (``minipaged.exercises.workbench``), plugged into the engine where
``spec_decode/verifier.py`` calls them:

    greedy_verify
        the same function as the exercise above, as a component: checked on the same cases
    rejection_sample(target_probs, draft_token_ids, draft_probs, generator) -> list[int]
        the sampled verification: keep draft i with probability min(1, p/q), at the first
        rejection draw the correction from the normalised residual max(0, p - q), and a bonus
        token from the last row when every draft is kept. Checked against the package's with
        the same generator seeds (the same tokens, the same random numbers used), and by the
        distribution of the first emitted token over many runs (it must be the target's).
"""
from __future__ import annotations

import torch

from minipaged.exercises import checking, workbench
from minipaged.exercises.checking import (CheckResult, Learner, exercise, fail,
                                          fail_if_changed, not_done, passed, rng_for)
from minipaged.spec_decode import rejection_sampler
from minipaged.worker.sampler import draw


_CHANGED = ("pop, remove, an in-place -= or clamp_, ...",
            "the engine reads them again after the verification (its acceptance counts use the "
            "drafts), so work on a copy or with indices")


def _greedy_verify_cases(verify, name: str, rng, num_cases: int) -> None:
    """Random guesses (none, all or some right) against the package's ``greedy_verify``."""
    for case in range(num_cases):
        k = rng.randint(0 if case % 10 == 9 else 1, 6)
        vocab = rng.choice([3, 5, 50])
        target = [rng.randrange(vocab) for _ in range(k + 1)]
        agree = rng.choice([0, k, rng.randint(0, k)])  # none, all, or some drafts right
        drafts = target[:agree] + [rng.randrange(vocab) for _ in range(k - agree)]
        expected = rejection_sampler.greedy_verify(list(target), list(drafts))
        given = (list(target), list(drafts))
        got = verify(*given)
        if isinstance(got, tuple):
            got = list(got)
        fail_if_changed(name, case, f"target_argmax_ids={target}, draft_token_ids={drafts}",
                        given, (target, drafts), ("target_argmax_ids", "draft_token_ids"),
                        *_CHANGED)
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
            fail(name, case, f"target_argmax_ids={target}, draft_token_ids={drafts}",
                 got, expected, hint)


@exercise
def check_greedy_verify(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("greedy_verify", fn)
    _greedy_verify_cases(learner, learner.name, rng_for(seed), num_cases)
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


# -- the build track: the two verifications, plugged in where spec_decode/verifier.py calls them --
def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int],
                     draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """Accept a prefix of the drafts and add one token; the output follows ``target_probs``.

    Args:
        target_probs: (k + 1, V) the target's probabilities ``p`` at each draft position and
            after the last draft.
        draft_token_ids: the ``k`` proposed ids.
        draft_probs: (k, V) the proposer's distributions ``q``, or ``None`` for a deterministic
            proposer (n-gram lookup): then ``q`` is one-hot at the draft.
        generator: the sequence's random generator (``None``: torch's global one).

    Draft i is kept with probability min(1, p(d) / q(d)): one uniform number
    ``torch.rand((), generator=generator, dtype=torch.float64)`` per examined draft, kept when
    ``u * q(d) < p(d)``. At the first rejection the correction is drawn from the residual
    max(0, p - q), normalised, and the verification ends; when all k are kept, a bonus token is
    drawn from row k. Draw every token with ``draw(probs, generator)`` (one random number each),
    so that a seeded request gives the same tokens as the package's; work in float64.
    """
    not_done()  # <- your code here


def greedy_verify(target_argmax_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """Accept drafts while they equal the target's choice, then add the target's own token.

    Args:
        target_argmax_ids: ``k + 1`` ids, the target's argmax at each draft position and after
            the last draft.
        draft_token_ids: the ``k`` proposed ids.
    """
    not_done()  # <- your code here


def _rounded(rows: torch.Tensor) -> list[list[float]]:
    return [[round(v, 3) for v in row] for row in rows.tolist()]


def _probability_rows(rng, rows: int, vocab: int) -> torch.Tensor:
    """(rows, vocab) random distributions, some with zeros."""
    if rows == 0:
        return torch.zeros(0, vocab)
    return torch.stack([_random_distribution(rng, vocab, rng.randint(0, vocab - 1)
                                             if rng.random() < 0.3 else 0)
                        for _ in range(rows)])


def _rejection_case(rng, case: int):
    """target_probs (k + 1, V), drafts, draft_probs (k, V) or None, and a seed."""
    k, vocab = rng.randint(0 if case % 10 == 9 else 1, 4), rng.randint(2, 8)
    target = _probability_rows(rng, k + 1, vocab)  # (k + 1, V)
    deterministic = case % 3 == 2
    draft_probs = None if deterministic else _probability_rows(rng, k, vocab)  # (k, V)
    drafts = []
    for i in range(k):
        if deterministic:
            drafts.append(rng.randrange(vocab))
        else:  # a draft is drawn from q, so it never has q(d) = 0
            weights = draft_probs[i].tolist()
            drafts.append(rng.choices(range(vocab), weights=weights)[0])
    return target, drafts, draft_probs, rng.randrange(2 ** 31)


def _rejection_hint(got: list, expected: list, drafts: list[int], deterministic: bool) -> str:
    """The hint keyed to the decision that went wrong first: keeping or rejecting a draft (the
    acceptance test), the correction after a rejection (the residual), or the bonus token."""
    k = len(drafts)
    if not isinstance(got, list) or not all(isinstance(t, int) for t in got):
        return "return a list of ints: the kept drafts, then one more token"
    common = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                  min(len(got), len(expected)))
    one_hot = " (draft_probs=None: q is one-hot at the draft)" if deterministic else ""
    acceptance = ("draft i is kept with probability min(1, p(d)/q(d)), tested with one uniform "
                  f"number per examined draft: kept when u * q(d) < p(d){one_hot}")
    if len(expected) == k + 1 and got == expected[:k]:
        return "when every draft is kept, the bonus token is drawn from the last row (row k)"
    if len(got) > k + 1 or (common == len(expected) and len(got) > len(expected)):
        return ("stop at the first rejected draft: the drafts after it were guessed after a "
                "token that is not emitted")
    if common < k and common < len(got) and common < len(expected):
        # at draft `common` one kept the draft and the other did not, or both rejected it
        kept_mine, kept_theirs = got[common] == drafts[common], expected[common] == drafts[common]
        if kept_mine != kept_theirs and (common < len(expected) - 1 or common < len(got) - 1):
            return acceptance
    if common < len(expected) - 1 or (common == len(got) and len(got) < len(expected)):
        return acceptance
    if len(expected) == k + 1 and got[:k] == expected[:k]:
        return "when every draft is kept, the bonus token is drawn from the last row (row k)"
    return ("after a rejection the correction is drawn from the residual: max(0, p - q) at that "
            "position, normalised to sum 1 (not p, not q: the accepted drafts already delivered "
            "min(p, q))")


def _first_token_frequencies(verify, target, draft_probs, runs: int, seed: int) -> torch.Tensor:
    """How often each token comes out first, drafts drawn from q[0], over ``runs`` runs."""
    generator = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(draft_probs[0], runs, replacement=True, generator=generator)
    counts = torch.zeros(target.shape[1], dtype=torch.float64)  # (V,)
    for d in drafts.tolist():
        counts[verify(target.clone(), [d], draft_probs.clone(), generator)[0]] += 1
    return counts / runs


def _check_rejection_sample(candidate, rng, num_cases: int) -> int:
    for case in range(num_cases):
        target, drafts, draft_probs, seed = _rejection_case(rng, case)
        theirs, mine = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        expected = rejection_sampler.rejection_sample(target, drafts, draft_probs, theirs)
        given = (target.clone(), list(drafts), None if draft_probs is None else draft_probs.clone())
        got = candidate(*given, mine)
        got = list(got) if isinstance(got, tuple) else got
        inputs = (f"target_probs={_rounded(target)}, draft_token_ids={drafts}, "
                  f"draft_probs={None if draft_probs is None else _rounded(draft_probs)}, "
                  f"generator seeded {seed}")
        fail_if_changed("rejection_sample", case, inputs, given, (target, drafts, draft_probs),
                        ("target_probs", "draft_token_ids", "draft_probs"), *_CHANGED)
        if got != expected:
            fail("rejection_sample", case, inputs, got, expected,
                 _rejection_hint(got, expected, drafts, draft_probs is None))
        if torch.rand((), generator=mine).item() != torch.rand((), generator=theirs).item():
            fail("rejection_sample", case, inputs, "the same tokens, but another number of "
                 "random numbers used", "one per examined draft and one per drawn token",
                 "draw each token with draw(probs, generator) and test each draft with one "
                 "uniform number: a seeded request must give the same tokens in any batch")
    # The promise itself: the first emitted token follows the target's p, whatever q is.
    runs = 3000
    for extra in range(2):
        vocab = 4 + extra
        target, draft_probs = _probability_rows(rng, 2, vocab), _probability_rows(rng, 1, vocab)
        got = _first_token_frequencies(candidate, target, draft_probs, runs, seed=extra)
        p = target[0].double()  # (V,)
        allowed = 4 * torch.sqrt(p * (1 - p) / runs) + 0.01  # (V,) about 4 standard errors
        if bool(((got - p).abs() > allowed).any()):
            fail("rejection_sample", num_cases + extra,
                 f"{runs} runs with k=1, p={[round(v, 3) for v in p.tolist()]}, "
                 f"q={[round(v, 3) for v in draft_probs[0].tolist()]}, drafts drawn from q: "
                 f"how often each token comes out first",
                 [round(v, 3) for v in got.tolist()], [round(v, 3) for v in p.tolist()],
                 "the first token must follow p (yours is off by more than 4 standard errors): "
                 "accepted drafts deliver min(p, q), the corrections must add exactly the rest, "
                 "the normalised residual max(0, p - q)")
    return num_cases + 2


def _check_greedy_verify_component(candidate, rng, num_cases: int) -> int:
    _greedy_verify_cases(candidate, "greedy_verify", rng, num_cases)
    return num_cases


for _name, _check in [("greedy_verify", _check_greedy_verify_component),
                      ("rejection_sample", _check_rejection_sample)]:
    workbench.register(workbench.Component(
        name=_name, lesson="12", slots=(f"minipaged.spec_decode.verifier:{_name}",),
        check=_check, solution=f"minipaged.exercises.answers.lesson12:{_name}",
        preamble="from minipaged.exercises.lesson12 import *"))


__all__ = ["check_greedy_verify", "check_residual_distribution", "usable_greedy_verify",
           "usable_residual", "greedy_verify", "rejection_sample", "draw", "not_done", "torch"]
