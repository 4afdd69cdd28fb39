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

The build track's component (``workbench``): ``Sampler``, the sampler's main method
(``MySampler.__call__``), checked against the package's ``Sampler`` on random rows and random
``SamplingParams`` (greedy, seeded, unseeded, beam search, penalties, ``logprobs``) and plugged
in where the engine builds its sampler.
"""
from __future__ import annotations

import math

import torch

from minipaged.exercises import checking, workbench
from minipaged.exercises.checking import (CheckResult, Learner, exercise, fail, not_done, passed,
                                          rng_for)
from minipaged.exercises.sampler_hints import (_generator_hint, _logprob_hint, _malformed,
                                               _processed, _short, _token_hint)
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup
from minipaged.worker.model_runner import Row
from minipaged.worker.sampler import (Sampler, SequenceOutput, apply_penalties, draw,
                                      sequence_generators, top_k_top_p_filter)

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


# -- the build track: the sampler ----------------------------------------------------------------
class MySampler(Sampler):
    """The package's sampler with its main method left to you; ``_beam_search`` is inherited."""

    def __call__(self, logits: torch.Tensor, rows: list[Row],
                 generators: dict[int, torch.Generator]) -> dict[str, dict[int, SequenceOutput]]:
        """The next token of every sequence of the step: {request_id: {seq_id: SequenceOutput}}.

        Args:
            logits: (R, V) one row per ``rows`` entry (``row.seq_group``, ``row.seq_ids``:
                several when a fresh group's sequences share their prompt's row).
            generators: one ``torch.Generator`` per sequence id, for its random draws.

        Per row: the presence and frequency penalties over the sequence's generated tokens,
        then the temperature (1 for greedy and beam search). Then per request: greedy takes the
        argmax; random sampling filters top-k then top-p and draws once per sequence with
        ``draw(probs, generators[seq_id])``; beam search calls
        ``self._beam_search(seq_group, its rows, their logprobs)``, which returns
        ``{seq_id: (k, parent_seq_id, token_id)}`` for every sequence of the group: ``k`` is
        the position, among the rows you passed, of the row (and logprobs) the token was chosen
        from, and the token continues sequence ``parent_seq_id`` (another beam, or itself). A
        ``SequenceOutput(parent seq id, token, logprobs)`` reports the chosen token's logprob
        (after penalties and temperature, before top-k/top-p) and, with ``logprobs=n``, the n
        most likely tokens'.
        """
        not_done()  # <- your code here


def _sampler_case(rng, case: int):
    """(logits (R, V), rows) of a random step: 1 to 4 requests of random kinds and settings."""
    vocab = rng.choice([6, 12, 40, 100])
    groups, seq_id = [], 0
    for g in range(rng.randint(1, min(4, 1 + case // 10))):  # small steps first
        kind = rng.choice(["greedy", "seeded", "seeded", "unseeded", "beam"])
        n = rng.choice([2, 3]) if kind == "beam" else rng.choice([1, 1, 2])
        params = SamplingParams(
            n=n, use_beam_search=kind == "beam",
            temperature=0.0 if kind in ("greedy", "beam") else rng.choice([0.5, 1.0, 1.7]),
            top_k=-1 if kind == "beam" else rng.choice([-1, -1, 1, 3, vocab // 2]),
            top_p=1.0 if kind == "beam" else rng.choice([1.0, 0.9, 0.6, 0.3, 0.1]),
            presence_penalty=rng.choice([0.0, 0.0, 0.5, -0.5, 1.5]),
            frequency_penalty=rng.choice([0.0, 0.0, 0.3, 1.0]),
            logprobs=rng.choice([None, 0, 1, 3]), seed=rng.randrange(10**6)
            if kind == "seeded" else None)
        seqs = [Sequence(seq_id + j, None, [rng.randrange(vocab) for _ in range(3)], 4)
                for j in range(n)]
        fresh = rng.random() < 0.4
        for seq in seqs if not fresh else ():  # decoding: some tokens generated already
            seq.output_token_ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
            seq.cumulative_logprob = -rng.uniform(0.0, 5.0)
        groups.append((fresh, SequenceGroup(f"req{g}", seqs, params, float(g))))
        seq_id += n
    groups.sort(key=lambda fg: not fg[0])  # prompt rows first, as in a step's batch
    rows = [r for fresh, group in groups for r in (
        [Row(group, [s.seq_id for s in group.seqs], True)] if fresh
        else [Row(group, [s.seq_id], False) for s in group.seqs])]
    g = torch.Generator().manual_seed(rng.randrange(10**9))
    logits = torch.randn(len(rows), vocab, generator=g) * rng.choice([1.0, 3.0])  # (R, V)
    processed = _processed(logits, rows)  # (R, V)
    for i, row in enumerate(rows):  # no top_p within a rounding error of a running sum
        params = row.seq_group.sampling_params
        if params.top_p < 1.0 and not _clear_top_p(processed[i], params):
            params.top_p = 1.0
    return logits, rows


def _clear_top_p(row, params) -> bool:
    kept = top_k_top_p_filter(row, params.top_k, 1.0)
    sums = torch.cumsum(torch.softmax(torch.sort(kept, descending=True).values, -1), -1)
    return bool(((sums - params.top_p).abs() > _MARGIN).all())


def _generators(rows):
    """The engine's generators: from the request's seed, or from a name when it has none."""
    generators = {}
    for row in rows:
        group = row.seq_group
        seed = group.sampling_params.seed
        generators.update(sequence_generators(f"engine/{group.request_id}" if seed is None
                                              else seed, [s.seq_id for s in group.seqs]))
    return generators


def _check_sampler(candidate, rng, num_cases: int) -> int:
    for case in range(num_cases):
        logits, rows = _sampler_case(rng, case)
        theirs, mine = _generators(rows), _generators(rows)
        expected = Sampler()(logits.clone(), rows, theirs)
        got = candidate()(logits.clone(), rows, mine)
        inputs = "; ".join(
            f"row {i}: {row.seq_group.request_id} seqs {row.seq_ids} "
            f"{_settings(row.seq_group.sampling_params)} generated "
            f"{row.seq_group.find(row.seq_ids[0]).output_token_ids}"
            for i, row in enumerate(rows)) + f"; vocab {logits.shape[-1]}"
        shape = {r: sorted(outs) for r, outs in expected.items()}
        malformed = _malformed(got, shape)
        if malformed is not None:  # read nothing more of it: say what is wrong with it
            fail("Sampler", case, inputs, _Shown(_short(got)),
                 _Shown("{request_id: {seq_id: SequenceOutput(parent_seq_id, token_id, "
                        f"logprobs)}} for {shape}"),
                 f"your `__call__` returned {_short(got)}: {malformed}")
        for request_id, outputs in expected.items():
            for seq_id, want in outputs.items():
                have = got[request_id][seq_id]
                row = next(r for r in rows if seq_id in r.seq_ids)
                where = inputs + f"; {request_id}, seq {seq_id}"
                if (have.parent_seq_id, have.token_id) != (want.parent_seq_id, want.token_id):
                    fail("Sampler", case, where + " (parent, token)",
                         (have.parent_seq_id, have.token_id), (want.parent_seq_id, want.token_id),
                         _token_hint(row, rows, logits, have.token_id, mine, theirs, seq_id))
                if not torch.equal(mine[seq_id].get_state(), theirs[seq_id].get_state()):
                    fail("Sampler", case, where + " (its generator afterwards)",
                         _Shown("not advanced by one draw"), _Shown("advanced by one draw"),
                         _generator_hint(row))
                if (sorted(have.logprobs) != sorted(want.logprobs)
                        or any(abs(have.logprobs[t] - v) > 1e-4 for t, v in want.logprobs.items())):
                    fail("Sampler", case, where + " (logprobs)", _rounded(have.logprobs),
                         _rounded(want.logprobs), _logprob_hint(row, rows, logits, have.logprobs))
    return num_cases


def _settings(p: SamplingParams) -> str:
    kind = "beam search" if p.use_beam_search else "greedy" if p.greedy else (
        f"seed {p.seed}" if p.seed is not None else "unseeded")
    return (f"({kind}, temperature {p.temperature}, top_k {p.top_k}, top_p {p.top_p}, presence "
            f"{p.presence_penalty}, frequency {p.frequency_penalty}, logprobs {p.logprobs})")


def _rounded(logprobs: dict) -> dict:
    return {t: round(v, 4) for t, v in sorted(logprobs.items())}


workbench.register(workbench.Component(
    name="Sampler", lesson="10",
    slots=("minipaged.engine.llm_engine:Sampler", "minipaged.lab.sampler_probe:Sampler"),
    check=_check_sampler, solution="minipaged.exercises.answers.lesson10:ReferenceSampler",
    preamble=("import torch\n\nfrom minipaged.exercises.checking import not_done\n"
              "from minipaged.worker.model_runner import Row\n"
              "from minipaged.worker.sampler import Sampler, SequenceOutput, draw"),
    num_cases=150))


__all__ = ["check_top_p_filter", "check_beam_step", "package_beam_step", "usable", "MySampler"]
