"""Lesson 20's runs of one greedy request, step by step, with the blocks it holds after each
step: under a sliding window (one table whose dropped entries are -1) and under KV cache groups
(the full group's table and each sliding group's). The lesson reads the tables they return.
"""
from __future__ import annotations

from minipaged.sampling_params import SamplingParams


def _add_greedy(llm, request_id: str, prompt: list[int], new: int):
    engine = llm.llm_engine
    engine.add_request(request_id, None,
                       SamplingParams(temperature=0, max_tokens=new, ignore_eos=True),
                       prompt_token_ids=prompt)
    return engine, engine.scheduler.block_manager


def run_and_watch(llm, prompt: list[int], new: int, picture_at: int | None = None):
    """(tokens, [(length, blocks held)] after each step, snapshots) of one greedy request.

    A dropped entry of the table is -1 and not counted as held. With ``picture_at`` (a
    length), the block manager's snapshots: after each step until a block first left the
    window, and when the sequence is ``picture_at`` tokens long.
    """
    engine, manager = _add_greedy(llm, "r", prompt, new)
    held, shots = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids  # (the last step's: all of them)
        for group in engine.scheduler.running:
            seq = group.get_seqs()[0]
            table = [b.block_number for b in manager.block_tables[seq.seq_id]]
            held.append((seq.get_len(), sum(b >= 0 for b in table)))
            dropped_yet = any(-1 in shot["sequences"][0]["block_table"] for shot in shots)
            if picture_at and (not dropped_yet or seq.get_len() == picture_at):
                shots.append(manager.snapshot())
    return tokens, held, shots


def run_groups(llm, prompt: list[int], new: int):
    """(tokens, [(length, full group's blocks, [each sliding group's blocks held])] after each
    step, every group's table at the end) of one greedy request under KV cache groups."""
    engine, manager = _add_greedy(llm, "g", prompt, new)
    held, tables = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        for seq_id, full in manager.block_tables.items():
            sliding = [g.num_held_blocks(g.seqs[seq_id]) for g in manager.groups]
            held.append((manager.seqs[seq_id].get_len(), len(full), sliding))
            tables = [[b.block_number for b in full]] + [
                [b.block_number for b in g.block_tables[seq_id]] for g in manager.groups]
    return tokens, held, tables
