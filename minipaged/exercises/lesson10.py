"""Lesson 10 exercises: the nucleus of top-p sampling, and one step of beam search.

    top_p_filter(logits, top_p) -> Tensor
        ``logits``: a 1-D float32 tensor (vocab,), possibly with -inf entries (tokens an earlier
        filter removed). Returns a tensor of the same shape: the logits of the tokens outside the
        nucleus become -inf, the others stay exactly as they were. The nucleus: sort the tokens
        from most to least likely; a token is dropped when the probabilities of the tokens before
        it already sum to top_p or more (so the token that makes the sum reach top_p is kept:
        the smallest set of most likely tokens whose probability reaches top_p). The most likely
        token is always kept; top_p = 1 keeps every token. Expected answer: the package's
        ``sampler.top_k_top_p_filter(logits, -1, top_p)`` (top_k = -1 turns top-k off).
    beam_step(cum_logprobs, logprobs, width) -> list[tuple[int, int]]
        ``cum_logprobs``: one float per live beam; ``logprobs``: a (beams, vocab) float32 tensor,
        each row the next-token logprobs of that beam. A candidate (beam, token) scores the
        beam's cumulative logprob plus the token's logprob. Returns the ``width`` best candidates
        of all beams together, best first. On the first step there is one row, the prompt,
        shared by all ``width`` beams (its cumulative logprob is 0); after that there are
        ``width`` beams. Expected answer: the candidates ``Sampler._beam_search`` keeps.

The checkers draw random cases with no ties that matter: no two logits are equal, a top_p other
than 1 is never within 1e-4 of a running sum, and no two of the best scores are within 1e-4.
top_p = 1 is the exception: a float32 running sum can reach 1.0 before the last (tiny)
probabilities, so it is a rule of its own (keep every token), checked before any sum.
"""
from __future__ import annotations

import math

import torch

from minipaged.exercises import checking
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup
from minipaged.worker.model_runner import Row
from minipaged.worker.sampler import Sampler, top_k_top_p_filter

_MARGIN = 1e-4  # no running sum, and no pair of competing scores, closer than this


class _Shown(str):
    """A tensor written out short, printed without quotes in the checker's message."""

    def __repr__(self) -> str:
        return str(self)


def _shown(values) -> _Shown:
    if not isinstance(values, torch.Tensor):
        return _Shown(repr(values))
    if values.dim() == 2:
        return _Shown("[" + ", ".join(_shown(row) for row in values) + "]")
    if values.numel() > 16:
        return _Shown(f"<{values.numel()} values>")
    return _Shown("[" + ", ".join("-inf" if v == float("-inf") else f"{v:.3f}"
                                  for v in values.tolist()) + "]")


def _random_logits(rng, vocab: int) -> torch.Tensor:
    scale = rng.choice([0.5, 1.0, 2.0, 4.0])
    logits = torch.tensor([rng.gauss(0.0, scale) for _ in range(vocab)], dtype=torch.float32)
    if vocab > 2 and rng.random() < 0.25:  # some tokens already removed by an earlier filter
        for i in rng.sample(range(vocab), rng.randint(1, vocab - 1)):
            logits[i] = float("-inf")
    return logits


def _top_p_for(rng, logits: torch.Tensor, case: int) -> float:
    """A top_p that is not within the margin of any running sum of sorted probabilities."""
    if case % 10 == 0:
        return 1.0
    probs = torch.softmax(torch.sort(logits, descending=True).values, dim=-1)  # (V,)
    sums = torch.cumsum(probs, dim=-1).tolist()
    for attempt in range(1000):
        top_p = (rng.choice([1e-3, 0.3, 0.5]) if case % 10 == 1 and attempt < 3
                 else round(rng.uniform(0.05, 0.99), 3))
        if all(abs(s - top_p) > _MARGIN for s in sums):
            return top_p
    return 1.0


@exercise
def check_top_p_filter(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("top_p_filter", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        vocab = rng.choice([1, 2, 3, 5, 8, 12]) if case < num_cases - 10 else rng.choice([50, 1000])
        logits = _random_logits(rng, vocab)
        top_p = _top_p_for(rng, logits, case)
        expected = top_k_top_p_filter(logits.clone(), -1, top_p)
        got = learner(logits.clone(), top_p)
        inputs = f"logits={_shown(logits)}, top_p={top_p}"
        if not isinstance(got, torch.Tensor) or got.shape != logits.shape:
            fail(learner.name, case, inputs, got if not isinstance(got, torch.Tensor)
                 else f"a tensor of shape {tuple(got.shape)}", f"a tensor of shape {(vocab,)}",
                 "return the logits with one entry per token, the dropped ones set to -inf")
        if torch.equal(got, expected):
            continue
        kept, got_kept = torch.isfinite(expected), torch.isfinite(got)
        if not torch.equal(got[got_kept & kept], logits[got_kept & kept]):
            hint = ("the kept tokens' logits stay exactly as they were: only the dropped ones "
                    "change, to -inf (no softmax, no renormalising)")
        elif top_p == 1.0:
            hint = ("top_p = 1 keeps every token, whatever a running sum says: in float32 the "
                    "sum can reach 1 before the last tiny probabilities, so decide it first")
        elif not got_kept.any():
            hint = "the most likely token is always kept, however small top_p is"
        elif int(got_kept.sum()) == int(kept.sum()) + 1:
            hint = ("a token is dropped as soon as the tokens more likely than it already "
                    "reach top_p")
        elif int(got_kept.sum()) == int(kept.sum()) - 1:
            hint = ("keep the token whose probability makes the sum reach top_p: the nucleus is "
                    "the smallest set of most likely tokens whose probability reaches top_p")
        else:
            hint = ("the nucleus is made of the most likely tokens: add up probabilities "
                    "(not logits) from the most likely token down")
        fail(learner.name, case, inputs, _shown(got), _shown(expected), hint)
    return passed(learner, num_cases)


def package_beam_step(cum_logprobs: list[float], logprobs: torch.Tensor,
                      width: int) -> list[tuple[int, int]]:
    """The candidates the package's ``Sampler._beam_search`` keeps, as (beam, token), best
    first (the package returns them per sequence; the order is by score)."""
    num_beams = logprobs.shape[0]
    params = SamplingParams(n=width, best_of=width, use_beam_search=True, temperature=0.0)
    if num_beams == 1:  # the first step: one prompt row shared by every beam
        seqs = [Sequence(i, None, [0], 16) for i in range(width)]
        group = SequenceGroup("beam", seqs, params, arrival_time=0.0)
        rows = [Row(group, [s.seq_id for s in seqs], True)]
    else:
        seqs = [Sequence(i, None, [0], 16) for i in range(num_beams)]
        for seq, cum in zip(seqs, cum_logprobs):
            seq.cumulative_logprob = cum
        group = SequenceGroup("beam", seqs, params, arrival_time=0.0)
        rows = [Row(group, [s.seq_id], False) for s in seqs]
    choices = Sampler._beam_search(group, rows, logprobs)
    kept = [(row_pos, token) for row_pos, _, token in choices.values()]
    scores = torch.tensor(cum_logprobs, dtype=logprobs.dtype)[:, None] + logprobs  # (B, V)
    return sorted(kept, key=lambda c: -float(scores[c[0], c[1]]))


def _beam_case(rng, case: int):
    width = rng.choice([2, 3, 4])
    num_beams = 1 if case % 4 == 0 else width
    vocab = rng.randint(max(width, 3), 8)
    for _ in range(1000):  # redraw until no two of the best scores are within the margin
        logits = [[rng.gauss(0.0, 2.0) for _ in range(vocab)] for _ in range(num_beams)]
        # (B, V) log-softmax of each row, in plain Python (no thread pool for tiny tensors)
        logprobs = torch.tensor([[x - max(row) - math.log(sum(math.exp(y - max(row)) for y in row))
                                  for x in row] for row in logits], dtype=torch.float32)
        cum = [0.0] if num_beams == 1 else [round(rng.uniform(-6.0, -0.5), 3)
                                            for _ in range(num_beams)]
        scores = sorted((torch.tensor(cum, dtype=torch.float64)[:, None]
                         + logprobs.double()).flatten().tolist(), reverse=True)
        if all(a - b > _MARGIN for a, b in zip(scores[:width + 1], scores[1:width + 1])):
            break
    return cum, logprobs, width


def _as_pairs(got):
    try:
        return [(int(beam), int(token)) for beam, token in got]
    except (TypeError, ValueError):
        return None


@exercise
def check_beam_step(fn, num_cases: int = 150, seed: int | None = 0) -> CheckResult:
    learner = Learner("beam_step", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        cum, logprobs, width = _beam_case(rng, case)
        expected = package_beam_step(cum, logprobs, width)
        got = learner(list(cum), logprobs.clone(), width)
        inputs = f"cum_logprobs={cum}, logprobs={_shown(logprobs)}, width={width}"
        pairs = _as_pairs(got)
        if pairs == expected:
            continue
        if pairs is None:
            hint = "return a list of (beam, token) pairs"
        elif len(pairs) != width:
            hint = "keep exactly width candidates: one per beam of the next step"
        elif set(pairs) == set(expected):
            hint = "best first: order the candidates by their score"
        elif set(pairs) == set(package_beam_step([0.0] * len(cum), logprobs, width)) and not (
                set(pairs) == {(b, int(torch.argmax(logprobs[b]))) for b in range(len(cum))}):
            hint = ("a candidate's score is its beam's cumulative logprob plus the token's "
                    "logprob: a beam that was already unlikely stays behind")
        elif set(pairs) == {(b, int(torch.argmax(logprobs[b]))) for b in range(len(cum))}:
            hint = ("the candidates of all beams compete together: one beam may give several "
                    "of the kept candidates, and another none (and each score counts its "
                    "beam's cumulative logprob)")
        else:
            hint = "score every (beam, token) pair, then keep the best width of them all"
        fail(learner.name, case, inputs, got, expected, hint)
    return passed(learner, num_cases)


def usable(fn):
    """``fn`` once its check passed, else the package's ``top_k_top_p_filter`` with top-k off."""
    return checking.usable("top_p_filter", fn,
                           lambda logits, top_p: top_k_top_p_filter(logits, -1, top_p))


__all__ = ["check_top_p_filter", "check_beam_step", "package_beam_step", "usable"]
