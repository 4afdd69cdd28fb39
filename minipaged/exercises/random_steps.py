"""Random engine steps as the worker receives them, for the build track's checkers (lessons 07, 08).

``random_step`` makes the ``SequenceRun``s of one step (``step_record.py``) the way a scheduler
hands them over: fresh prompts (some the first chunk of a longer prompt, some shared by the two
sequences of a fresh ``n = 2`` group), chunks after a cached context, and decode tokens, in a
random order, each sequence with its own blocks scattered over a pool. ``describe`` names the
runs in one line for a checker's message.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup
from minipaged.step_record import SequenceRun


@dataclass
class RandomStep:
    runs: list[SequenceRun]
    block_size: int
    num_blocks: int  # blocks in the pool (every block table's entries are below it)


def random_step(rng: random.Random, block_size: int, max_runs: int = 5) -> RandomStep:
    """One step of 1 to ``max_runs`` runs; every sequence's block table covers its run's end."""
    kinds = [rng.choice(("prompt", "prompt", "chunk", "decode", "decode", "shared prompt"))
             for _ in range(rng.randint(1, max_runs))]
    tables_needed = []
    spans = []  # (start, number of tokens) per run
    for kind in kinds:
        if kind in ("prompt", "shared prompt"):
            start, count = 0, rng.randint(1, 3 * block_size + 1)
        elif kind == "chunk":
            start, count = rng.randint(1, 3 * block_size + 1), rng.randint(1, 2 * block_size)
        else:
            start, count = rng.randint(1, 4 * block_size), 1  # after its prompt
        spans.append((start, count))
        tables_needed.append(-(-(start + count) // block_size))
    num_blocks = sum(tables_needed) + rng.randint(0, 3)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered physical blocks: a table is never just 0, 1, 2, ...
    runs = []
    seq_id = 0
    for i, (kind, (start, count), needed) in enumerate(zip(kinds, spans, tables_needed)):
        table, free = free[:needed], free[needed:]
        tokens = [rng.randrange(1000) for _ in range(start + count)]
        num_seqs = 2 if kind == "shared prompt" else 1
        seqs = [Sequence(seq_id + j, None, tokens, block_size) for j in range(num_seqs)]
        group = SequenceGroup(f"r{i}", seqs, SamplingParams(n=num_seqs), arrival_time=float(i))
        runs.append(SequenceRun(
            seq_group=group, seq_ids=[s.seq_id for s in seqs], token_ids=tokens[start:],
            start=start, block_table=table,
            sample=kind == "decode" or rng.random() < 0.7,  # else a first chunk of a long prompt
            is_prompt=kind != "decode"))
        seq_id += num_seqs
    return RandomStep(runs, block_size, num_blocks)


def describe(step: RandomStep) -> str:
    """The runs of ``step`` in one line: kind, positions, block table."""
    parts = []
    for run in step.runs:
        if not run.is_prompt:
            kind = "decode"
        elif run.start == 0:
            kind = "prompt" if len(run.seq_ids) == 1 else "prompt of 2 sequences"
        else:
            kind = "chunk after a cached context"
        parts.append(f"{kind} {run.seq_ids} positions {run.start}..{run.end - 1} "
                     f"table {run.block_table}")
    return f"block_size={step.block_size}; runs in order: " + "; ".join(parts)
