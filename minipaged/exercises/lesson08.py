"""Lesson 08 exercises: the flat batch of one engine step.

``SeqView(token_ids, num_computed_tokens, block_table)``: a scheduled sequence (in any order). A sequence with ``num_computed_tokens == 0`` is a prompt run (all its tokens
are computed this step); any other computes only its newest token (a decode).

    flat_batch(seqs) -> (input_ids, positions)
        every prompt's tokens, packed one after another, then one token per decode
    sample_indices(seqs) -> list[int]
        the rows of that flat batch whose hidden state becomes a next-token distribution: the
        model computes one row per token, but only the last token of a prompt and the token of
        a decode have a next token to sample; the rows in batch order

Expected answers: ``lab.batch_inputs.prepare_inputs_for_groups`` on random steps of a real
``Scheduler``, mixing new prompts, decodes and preempted requests.

The build track's component (``workbench``): ``prepare_inputs``, the engine's own
(``worker/model_runner.py``), written in ``my_prepare_inputs``; checked field by field against
the package's on random ``SequenceRun`` lists and plugged in where the engine calls it.
"""
from __future__ import annotations

import torch
from typing import NamedTuple

from minipaged.exercises import workbench
from minipaged.exercises.checking import (CheckResult, Learner, exercise, fail, not_done, passed,
                                          rng_for)
from minipaged.exercises.random_steps import describe, random_step
from minipaged.lab.dry_run import RandomTraffic
from minipaged.lab.batch_inputs import prepare_inputs_for_groups
from minipaged.models.input_metadata import InputMetadata
from minipaged.sequence import SequenceStatus
from minipaged.step_record import SequenceRun
from minipaged.worker.model_runner import PreparedInputs, Row
from minipaged.worker.model_runner import prepare_inputs as package_prepare_inputs


class SeqView(NamedTuple):
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]


def _random_batches(rng, num_cases):
    """(seq views, block size, the package's PreparedInputs) for random mixed steps."""
    cases = 0
    while cases < num_cases:
        block_size = rng.choice([1, 2, 4, 8])
        traffic = RandomTraffic(rng, block_size, rng.randint(6, 24),
                                preemption_mode=rng.choice(["swap", "recompute"]))
        for _ in range(rng.randint(4, 20)):
            traffic.arrive(rng.choice([0, 1, 1, 2]))
            outs = traffic.scheduler.schedule()
            # Any order of the groups is a valid input of prepare_inputs_for_groups: mix them
            # up, so that "prompts first" is something the answer has to do.
            groups = rng.sample(outs.scheduled_seq_groups, len(outs.scheduled_seq_groups))
            seqs = [SeqView(s.get_token_ids(), s.num_computed_tokens,
                            traffic.bm.get_block_table(s))
                    for g in groups for s in g.get_seqs(SequenceStatus.RUNNING)]
            if seqs:
                batch = prepare_inputs_for_groups(groups, traffic.bm, block_size,
                                                  torch.device("cpu"))
                yield seqs, block_size, batch
                cases += 1
            traffic.after_model(outs)


def _show(seqs) -> str:
    return "[" + ", ".join(f"SeqView({len(s.token_ids)} tokens ..{s.token_ids[-3:]}, computed "
                           f"{s.num_computed_tokens}, table {s.block_table})" for s in seqs) + "]"


@exercise
def check_flat_batch(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("flat_batch", fn)
    for case, (seqs, _, batch) in enumerate(_random_batches(rng_for(seed), num_cases)):
        expected = (batch.input_ids.tolist(), batch.positions.tolist())
        got = learner(list(seqs))
        got = (list(map(int, got[0])), list(map(int, got[1])))
        if got != expected:
            if sorted(got[0]) == sorted(expected[0]) and got[0] != expected[0]:
                hint = "the right tokens in the wrong order: the prompt runs come first"
            elif got[0] == expected[0]:
                hint = ("a position is where the token stands in its own sequence, as the "
                        "model saw it when the sequence was one long prompt")
            else:
                hint = ("which tokens does each sequence still need computed this step? a "
                        "prompt run has none in the cache yet; a decode has all but one")
            fail(learner.name, case, _show(seqs), got, expected, hint)
    return passed(learner, num_cases)


@exercise
def check_sample_indices(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("sample_indices", fn)
    for case, (seqs, _, batch) in enumerate(_random_batches(rng_for(seed), num_cases)):
        expected = batch.sample_indices.tolist()
        got = list(map(int, learner(list(seqs))))
        if got != expected:
            if len(got) != len(expected):
                hint = (f"one row per sequence ({len(expected)} here): a prompt's earlier tokens "
                        f"already have their next token (it is the prompt's next token)")
            elif sorted(got) == sorted(expected):
                hint = "the right rows in the wrong order: follow the flat batch's order"
            else:
                hint = ("a row number counts tokens of the flat batch: where does each "
                        "sequence's last token land once the prompts before it are packed?")
            fail(learner.name, case, _show(seqs), got, expected, hint)
    return passed(learner, num_cases)


# -- the build track: prepare_inputs ---------------------------------------------------------------
def my_prepare_inputs(seq_runs: list[SequenceRun], block_size: int, device: torch.device,
                      drafts: dict[int, list[int]] | None = None) -> PreparedInputs:
    """The flat batch of one step, from the scheduler's record of it (plain data).

    Args:
        seq_runs: the step's runs, in any order; each has ``token_ids``, ``start`` (position of
            its first token), ``end``, ``block_table``, ``seq_ids``, ``seq_group``, ``sample``
            and ``is_prompt`` (see ``step_record.SequenceRun``).
        block_size: tokens per block.
        device: where the tensors go.
        drafts: speculative decoding's proposed tokens (lesson 12): left to the package here.

    Lay the tokens out as [fresh prompts (start 0) | chunks after a cached context | one token
    per decode], each kind in the order of ``seq_runs``, and return a ``PreparedInputs`` with
    ``input_ids`` and ``positions`` (int64), the ``InputMetadata`` (``slot_mapping`` int64; tables
    padded with 0 and lengths int32), a ``Row`` and a ``sample_indices`` entry for each run
    that samples, ``computed`` = (sequence, run end) for every sequence of every run, and
    ``chunks`` = the prefill runs in batch order.
    """
    if any(drafts.values() if drafts else ()):
        return package_prepare_inputs(seq_runs, block_size, device, drafts)  # lesson 12's steps
    not_done()  # <- your code here


_FIELD_HINTS = {
    "input_ids": "fresh prompts (start 0) first, then chunks after a cached context, then one "
                 "token per decode; within each kind keep the order of seq_runs",
    "positions": "a run's tokens stand at positions start, start + 1, ..., end - 1 (a decode's "
                 "one token at run.start: the sequence's length minus one)",
    "meta.slot_mapping": "a token's slot goes through its sequence's block table: "
                         "block_table[position // block_size] * block_size + the offset",
    "meta.prompt_lens": "one length per fresh prompt (start 0), in batch order",
    "meta.num_chunk_tokens": "the tokens of the chunks that continue a cached context",
    "meta.chunk_query_start_loc": "where each chunk's tokens start within the chunk part, "
                                  "beginning with 0 and ending with their total",
    "meta.chunk_block_tables": "one block table per chunk, padded with 0 to the longest",
    "meta.chunk_context_lens": "a chunk reads its context up to its own end (run.end)",
    "meta.block_tables": "one block table per decode, padded with 0 to the longest",
    "meta.context_lens": "a decode token attends to its whole context, itself included (run.end)",
    "meta.max_context_len": "the largest context length of the decodes (0 without decodes)",
    "sample_indices": "the row of the last token of each run that samples, in batch order",
    "rows": "a Row(seq_group, seq_ids, is_prompt) per run that samples, in batch order",
    "computed": "(the Sequence, run.end) for each sequence of each run, in batch order "
                "(seq_group.find(seq_id) gives the Sequence)",
    "chunks": "the prefill runs in batch order: fresh prompts, then the chunks",
}


def _fields(prepared: PreparedInputs) -> dict:
    """What the checker compares, as plain values (tensors as (dtype, list))."""
    def plain(value):
        if isinstance(value, torch.Tensor):
            return (str(value.dtype).replace("torch.", ""), value.tolist())
        return value
    meta = prepared.meta
    return {
        "input_ids": plain(prepared.input_ids), "positions": plain(prepared.positions),
        **{f"meta.{name}": plain(getattr(meta, name)) for name in (
            "slot_mapping", "prompt_lens", "num_chunk_tokens", "chunk_query_start_loc",
            "chunk_block_tables", "chunk_context_lens", "block_tables", "context_lens",
            "max_context_len")},
        "sample_indices": plain(prepared.sample_indices),
        "rows": [(r.seq_group.request_id, list(r.seq_ids), r.is_prompt) for r in prepared.rows],
        "computed": [(seq.seq_id, id(seq), end) for seq, end in prepared.computed],
        "chunks": [id(run) for run in prepared.chunks],
    }


def _check_prepare_inputs(candidate, rng, num_cases: int) -> int:
    """Random steps (fresh prompts, first chunks, chunks after a cached context, decodes, a
    prompt shared by two sequences, in any order; block sizes 1 to 16), field by field."""
    for case in range(num_cases):
        step = random_step(rng, rng.choice([1, 2, 4, 8, 16]), max_runs=6)
        expected = _fields(package_prepare_inputs(step.runs, step.block_size,
                                                  torch.device("cpu")))
        before, said = [_run_fields(run) for run in step.runs], describe(step)
        given = list(step.runs)
        got = candidate(given, step.block_size, torch.device("cpu"))
        changed = next((i for i, run in enumerate(step.runs)
                        if _run_fields(run) != before[i]), None)
        if changed is not None or [id(r) for r in given] != [id(r) for r in step.runs]:
            where = ("the list of runs (reordered, or runs added or taken out)" if changed is None
                     else f"run {changed}")
            fail("prepare_inputs", case, said, f"{where} changed by your code",
                 "the step's runs as given",
                 "your prepare_inputs changed the step it was given (a block table padded in "
                 "place, the runs sorted, a token list extended, ...): the engine reads the same "
                 "runs again after the model ran (the sampler), so build new lists")
        if not isinstance(got, PreparedInputs):
            fail("prepare_inputs", case, describe(step), type(got).__name__, "PreparedInputs",
                 "return a PreparedInputs(input_ids, positions, meta, rows, sample_indices, "
                 "computed, chunks)")
        malformed = _malformed(got)
        if malformed is not None:  # read nothing more of it: say what is wrong with it
            fail("prepare_inputs", case, describe(step), _Said(malformed[0]),
                 _Said(malformed[1]), f"your prepare_inputs returned a PreparedInputs whose "
                 f"{malformed[2]}")
        got = _fields(got)
        for name, value in expected.items():
            if got[name] != value:
                hint = _FIELD_HINTS[name]
                if isinstance(value, tuple) and not isinstance(got[name], tuple):
                    hint = (f"{name} must be a tensor of {value[0]} (yours is a "
                            f"{type(got[name]).__name__}); " + hint)
                elif (isinstance(value, tuple) and isinstance(got[name], tuple)
                        and got[name][1] == value[1]):
                    hint = f"the right numbers as {got[name][0]}: InputMetadata wants {value[0]}"
                elif name in ("computed", "chunks"):
                    got[name], value = (_names(got[name], step), _names(value, step))
                fail("prepare_inputs", case, describe(step) + f"; field {name}", got[name],
                     value, hint)
    return num_cases


def _run_fields(run) -> tuple:
    """What a run holds, copied (to see whether the learner's code changed it)."""
    return (list(run.seq_ids), list(run.token_ids), run.start, list(run.block_table), run.sample,
            run.is_prompt, tuple(tuple(t) for t in run.other_block_tables))


class _Said(str):
    """Words in the checker's message, printed without quotes."""

    def __repr__(self) -> str:
        return str(self)


def _malformed(got: PreparedInputs) -> tuple[str, str, str] | None:
    """(yours, expected, what is wrong) when the fields the checker reads are not what they
    must be: meta an InputMetadata, rows ``Row``s, computed (Sequence, int) pairs; else None."""
    if not isinstance(got.meta, InputMetadata):
        return (f"meta = {type(got.meta).__name__}", "meta = InputMetadata(...)",
                "meta must be an InputMetadata(prompt_lens, slot_mapping, block_tables, "
                "context_lens, max_context_len, chunk_query_start_loc, chunk_block_tables, "
                "chunk_context_lens, num_chunk_tokens)")
    rows = got.rows if isinstance(got.rows, list) else None
    if rows is None or not all(isinstance(r, Row) for r in rows):
        return (f"rows = {got.rows!r}"[:160], "rows = [Row(seq_group, seq_ids, is_prompt), ...]",
                "rows must be a list of Row(seq_group, seq_ids, is_prompt), one per run that "
                "samples")
    computed = got.computed if isinstance(got.computed, list) else None
    if computed is None or not all(isinstance(c, tuple) and len(c) == 2
                                   and hasattr(c[0], "seq_id") and isinstance(c[1], int)
                                   for c in computed):
        return (f"computed = {got.computed!r}"[:160], "computed = [(Sequence, int), ...]",
                "computed must be a list of (the Sequence, run.end) pairs "
                "(seq_group.find(seq_id) gives the Sequence)")
    if not isinstance(got.chunks, list):
        return (f"chunks = {got.chunks!r}"[:160], "chunks = [SequenceRun, ...]",
                "chunks must be the list of the prefill runs (SequenceRun), in batch order")
    return None


def _names(entries, step) -> list:
    """``computed`` / ``chunks`` entries with object ids replaced by what they name."""
    runs = {id(run): f"run of seqs {run.seq_ids} from {run.start}" for run in step.runs}
    return [runs.get(e, "?") if isinstance(e, int) else (f"seq {e[0]}", e[2]) for e in entries]


workbench.register(workbench.Component(
    name="prepare_inputs", lesson="08",
    slots=("minipaged.engine.llm_engine:prepare_inputs", "minipaged.lab.batch_inputs:prepare_inputs"),
    check=_check_prepare_inputs, solution="minipaged.exercises.answers.lesson08:prepare_inputs",
    preamble="from minipaged.exercises.lesson08 import *"))
