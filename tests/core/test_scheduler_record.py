"""The block manager behind the scheduler (lessons 04 and 08): the worker gets plain data.

The scheduler's record of a step (``SchedulerOutputs.seq_runs``) must say exactly what the
block manager holds: each run's tokens, first position and block table. ``prepare_inputs`` reads
only that record, so a flat batch can be built with no block manager at all. And only the
allocators write a block's reference count.
"""
from __future__ import annotations

import ast
import pathlib

import torch
from hypothesis import given, settings, strategies as st

from minipaged.lab.dry_run import DryRun
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.step_record import SequenceRun
from minipaged.worker.model_runner import prepare_inputs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_prepare_inputs_reads_only_the_plain_record():
    """A prompt and a decode made by hand, with block tables no block manager ever saw: the
    slots are block * block_size + offset of the tables given."""
    # The group's sequences hold other tokens: positions and slots must come from the runs.
    seq_group = SequenceGroup("r", [Sequence(0, None, [1, 2], 4), Sequence(1, None, [3], 4)],
                              SamplingParams(), 0.0)
    prompt = SequenceRun(seq_group, [0], [11, 12, 13, 14, 15], 0, [7, 3], False, True)
    decode = SequenceRun(seq_group, [1], [99], 9, [2, 5, 6], False, False)
    batch = prepare_inputs([decode, prompt], 4, torch.device("cpu"))
    assert batch.input_ids.tolist() == [11, 12, 13, 14, 15, 99]  # prompts first
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 9]
    assert batch.meta.slot_mapping.tolist() == [28, 29, 30, 31, 12, 6 * 4 + 1]
    assert batch.meta.block_tables.tolist() == [[2, 5, 6]]
    assert batch.meta.context_lens.tolist() == [10]
    assert batch.meta.prompt_lens == [5]
    assert [(seq.seq_id, n) for seq, n in batch.computed] == [(0, 5), (1, 10)]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 11), st.integers(1, 3)), min_size=1, max_size=6),
       st.integers(6, 14), st.sampled_from(["swap", "recompute", None]),
       st.integers(0, 2 ** 31))
def test_the_record_says_what_the_block_manager_holds(requests, num_gpu_blocks, mode, seed):
    """On random traffic with preemption, each step's runs carry each sequence's tokens, its
    first position and its block table as the block manager has them when the step runs."""
    run = DryRun(block_size=4, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=32,
                 preemption_mode=mode)
    for i, (length, n) in enumerate(requests):
        run.add_request([(seed + i * 7 + t) % 500 for t in range(length)], n=n)
    bm = run.block_manager
    for _ in range(60):
        if not run.scheduler.has_unfinished_seqs():
            break
        outs = run.scheduler.schedule()
        chunk_runs = [r for r in outs.seq_runs if r.is_prompt]
        decode_runs = [r for r in outs.seq_runs if not r.is_prompt]
        assert len(chunk_runs) == len(outs.prefill_chunks)
        for r, chunk in zip(chunk_runs, outs.prefill_chunks):
            assert (r.start, r.end, r.seq_ids, r.sample) == (
                chunk.start, chunk.end, chunk.seq_ids, chunk.sample)
            assert r.token_ids == chunk.seq.get_token_ids()[chunk.start:chunk.end]
            assert r.block_table == bm.get_block_table(chunk.seq)
            assert all(type(b) is int for b in r.block_table)
        decoding = [s for g in outs.decode_seq_groups for s in g.get_seqs(SequenceStatus.RUNNING)]
        assert [r.seq_ids for r in decode_runs] == [[s.seq_id] for s in decoding]
        for r, seq in zip(decode_runs, decoding):
            assert r.token_ids == [seq.get_last_token_id()] and r.start == seq.get_len() - 1
            assert r.block_table == bm.get_block_table(seq)
            assert len(r.block_table) * 4 >= r.end  # the slot of the new token exists
        run.sampled(outs)
        for seq_group in list(run.scheduler.running):
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                if seq.get_output_len() >= 3:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                    run.scheduler.free_seq(seq)
        run.scheduler.free_finished_seq_groups()


def test_only_the_allocators_write_reference_counts():
    """The pool owns its counts: nothing else assigns to ``ref_count``."""
    allowed = {"minipaged/block.py", "minipaged/core/allocator.py",
               "minipaged/core/prefix_caching_allocator.py",
               # the build track's answers that are allocators (lessons 02 and 11)
               "minipaged/exercises/answers/lesson02.py", "minipaged/exercises/answers/lesson11.py",
               # lesson 19's mystery engines: faults that break the counts on purpose
               "minipaged/exercises/lesson19.py", "minipaged/exercises/lesson19_reported.py"}
    writers = []
    for path in sorted((ROOT / "minipaged").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                       else [])
            if any(isinstance(t, ast.Attribute) and t.attr == "ref_count" for t in targets):
                writers.append(str(path.relative_to(ROOT)))
    assert set(writers) <= allowed, sorted(set(writers) - allowed)
    assert writers, "the scan found no writer at all: it is not looking"
