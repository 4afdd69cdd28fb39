"""Reference answer of lesson 08's component: ``prepare_inputs``, one step as one flat batch.

The learner's stub is ``minipaged.exercises.lesson08.my_prepare_inputs``; this is one way to
fill it. Steps with drafts (speculative decoding, lesson 12) go to the package's own.
"""
from __future__ import annotations

import torch

from minipaged.models.input_metadata import InputMetadata
from minipaged.step_record import SequenceRun
from minipaged.worker.model_runner import PreparedInputs, Row
from minipaged.worker.model_runner import prepare_inputs as package_prepare_inputs


def prepare_inputs(seq_runs: list[SequenceRun], block_size: int, device: torch.device,
                   drafts: dict[int, list[int]] | None = None) -> PreparedInputs:
    """The flat batch of one step: [fresh prompts | chunks after a cached context | decodes]."""
    if any(drafts.values() if drafts else ()):
        return package_prepare_inputs(seq_runs, block_size, device, drafts)  # lesson 12

    def slot(table: list[int], position: int) -> int:
        # lesson 02: the physical block of the position's logical block, then the offset in it
        return table[position // block_size] * block_size + position % block_size

    prefills = [run for run in seq_runs if run.is_prompt]
    fresh = [run for run in prefills if run.start == 0]
    chunks = [run for run in prefills if run.start > 0]
    decodes = [run for run in seq_runs if not run.is_prompt]

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[Row] = []
    sample_indices: list[int] = []
    computed = []
    for run in fresh + chunks + decodes:
        input_ids += run.token_ids
        for position in range(run.start, run.end):
            positions.append(position)
            slots.append(slot(run.block_table, position))
        if run.sample:  # the run's last token gives the next token of each of its sequences
            sample_indices.append(len(input_ids) - 1)
            rows.append(Row(run.seq_group, list(run.seq_ids), run.is_prompt))
        computed += [(run.seq_group.find(seq_id), run.end) for seq_id in run.seq_ids]

    def table_tensor(tables: list[list[int]]) -> torch.Tensor:  # (n, widest), padded with 0
        width = max((len(t) for t in tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.int32).view(len(tables), width)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    chunk_starts = [0]
    for run in chunks:  # where each chunk's tokens start within the chunk part
        chunk_starts.append(chunk_starts[-1] + run.num_tokens)
    context_lens = [run.end for run in decodes]  # a decode reads its whole context
    meta = InputMetadata(
        prompt_lens=[run.num_tokens for run in fresh],
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=table_tensor([run.block_table for run in decodes]),
        context_lens=ints(context_lens),
        max_context_len=max(context_lens, default=0),
        chunk_query_start_loc=ints(chunk_starts),
        chunk_block_tables=table_tensor([run.block_table for run in chunks]),
        chunk_context_lens=ints([run.end for run in chunks]),
        num_chunk_tokens=chunk_starts[-1],
    )
    for name in ("slot_mapping", "block_tables", "context_lens", "chunk_query_start_loc",
                 "chunk_block_tables", "chunk_context_lens"):
        setattr(meta, name, getattr(meta, name).to(device))
    return PreparedInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta, rows=rows,
        sample_indices=torch.tensor(sample_indices, dtype=torch.long, device=device),
        computed=computed, chunks=fresh + chunks)
