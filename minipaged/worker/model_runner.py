"""Turning a scheduled step into one flat batch and running the model on it (lesson 08).

It reads the scheduler's record of the step (``step_record.SequenceRun``: tokens, positions and
block tables as plain ints), never the block manager. All the step's tokens go into one sequence
of tokens: first the prompts computed from scratch (packed one after another), then chunks that
continue a context already in the cache (a long prompt's later chunks, the recompute of a group
after preemption), then one token per decoding sequence. Alongside them:
``positions``, ``slot_mapping`` (where each token's K/V go), and for the chunks and decode tokens
their ``block_tables`` and context lengths.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from minipaged.models import decode_plan
from minipaged.models.input_metadata import InputMetadata
from minipaged.sequence import Sequence, SequenceGroup
from minipaged.step_record import SequenceRun


@dataclass
class Row:
    """One row of the step's logits: the next-token distribution of some sequences."""

    seq_group: SequenceGroup
    seq_ids: list[int]  # several when a fresh group's sequences share one prompt computation
    is_prompt: bool


@dataclass
class SpecRow:
    """Speculative decoding (lesson 12): a sequence verifying ``draft_token_ids`` (k of them).

    Its newest token and the k drafts run as one chunk over its cached prefix; the step's logits
    then hold k + 1 rows for it, after the rows of ``PreparedInputs.rows``, in order: the
    target's distribution at each draft position, and after the last draft.
    """

    seq_group: SequenceGroup
    seq_id: int
    draft_token_ids: list[int]


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: InputMetadata
    rows: list[Row]
    sample_indices: torch.Tensor  # (R,) which of the T tokens produce a next-token distribution
    computed: list[tuple[Sequence, int]]  # after the step: (sequence, its num_computed_tokens)
    chunks: list[SequenceRun] = field(default_factory=list)  # the prefill part, in batch order
    spec_rows: list[SpecRow] = field(default_factory=list)  # their logits follow ``rows``'


def _pad(tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int32).view(len(padded), width)


def _add_positions(positions: list[torch.Tensor], slots: list[torch.Tensor],
                   table: list[int], start: int, end: int, block_size: int) -> None:
    """Appends the positions [start, end) of one chunk and the KV slots they write to."""
    pos = torch.arange(start, end)  # (n,)
    positions.append(pos)
    slots.append(torch.tensor(table)[pos // block_size] * block_size + pos % block_size)


def prepare_inputs(seq_runs: list[SequenceRun], block_size: int, device: torch.device,
                   drafts: dict[int, list[int]] | None = None) -> PreparedInputs:
    """The flat batch of one step, from the scheduler's record of it (plain data).

    Args:
        seq_runs: the step's prefill runs and decode runs (``SchedulerOutputs.seq_runs``), each
            with its tokens, first position and block table.
        block_size: tokens per block.
        device: where the tensors go (the worker's ``device``).
        drafts: speculative decoding (lesson 12): the proposed tokens of decoding sequences,
            by sequence id; such a sequence runs as a chunk (its newest token and the drafts,
            in the slots the scheduler reserved) and gets a ``SpecRow``.
    """
    drafts = {seq_id: d for seq_id, d in (drafts or {}).items() if d}
    chunks = [r for r in seq_runs if r.is_prompt]
    decodes = [r for r in seq_runs if not r.is_prompt]
    # Prompts from scratch first, then chunks that read a cached context.
    chunks = [c for c in chunks if c.start == 0] + [c for c in chunks if c.start > 0]

    input_ids: list[int] = []
    positions: list[torch.Tensor] = []  # pieces, concatenated once at the end
    slots: list[torch.Tensor] = []
    prompt_lens: list[int] = []
    chunk_lens: list[int] = []
    chunk_tables: list[list[int]] = []
    chunk_ends: list[int] = []
    rows: list[Row] = []
    sample_indices: list[int] = []
    computed: list[tuple[Sequence, int]] = []

    # 1. Prefill runs: tokens [start, end) of a sequence.
    for chunk in chunks:
        seq_group = chunk.seq_group
        input_ids += chunk.token_ids
        _add_positions(positions, slots, chunk.block_table, chunk.start, chunk.end, block_size)
        if chunk.start == 0:
            prompt_lens.append(chunk.num_tokens)
        else:
            chunk_lens.append(chunk.num_tokens)
            chunk_tables.append(chunk.block_table)
            chunk_ends.append(chunk.end)
        if chunk.sample:
            sample_indices.append(len(input_ids) - 1)
            rows.append(Row(seq_group, list(chunk.seq_ids), True))
        computed += [(seq_group.find(seq_id), chunk.end) for seq_id in chunk.seq_ids]

    # 1b. Verifications (lesson 12): [newest token, d1..dk] at positions L-1 .. L+k-1, a chunk
    # over the cached prefix whose every token gives a row of logits (they go last).
    spec_rows: list[SpecRow] = []
    spec_indices: list[int] = []
    for run in decodes:
        seq_id = run.seq_ids[0]
        if seq_id not in drafts:
            continue
        draft = drafts[seq_id]
        spec_indices += range(len(input_ids), len(input_ids) + 1 + len(draft))
        input_ids += run.token_ids + draft
        _add_positions(positions, slots, run.block_table, run.start, run.end + len(draft),
                       block_size)
        chunk_lens.append(1 + len(draft))
        chunk_tables.append(run.block_table)
        chunk_ends.append(run.end + len(draft))
        spec_rows.append(SpecRow(run.seq_group, seq_id, list(draft)))

    # 2. Decodes: one new token per running sequence whose earlier tokens are cached.
    block_tables: list[list[int]] = []
    context_lens: list[int] = []
    decode_positions: list[int] = []
    decode_slots: list[int] = []
    for run in decodes:
        seq_id, pos, table = run.seq_ids[0], run.start, run.block_table
        if seq_id in drafts:
            continue  # verified as a chunk above
        input_ids += run.token_ids
        decode_positions.append(pos)
        decode_slots.append(table[pos // block_size] * block_size + pos % block_size)
        block_tables.append(table)
        context_lens.append(run.end)
        sample_indices.append(len(input_ids) - 1)
        rows.append(Row(run.seq_group, [seq_id], False))
        computed.append((run.seq_group.find(seq_id), run.end))

    positions.append(torch.tensor(decode_positions, dtype=torch.long))
    slots.append(torch.tensor(decode_slots, dtype=torch.long))

    # Built on the host, copied to the device once for all of them.
    chunk_loc = torch.tensor([0] + chunk_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    (input_ids_t, positions_t, sample_t, slot_mapping, block_tables, context_lens_t, chunk_loc,
     chunk_block_tables, chunk_ends_t) = to_device_at_once([
        torch.tensor(input_ids, dtype=torch.long), torch.cat(positions).long(),
        torch.tensor(sample_indices + spec_indices, dtype=torch.long),
        torch.cat(slots).long(), _pad(block_tables), torch.tensor(context_lens, dtype=torch.int32),
        chunk_loc, _pad(chunk_tables), torch.tensor(chunk_ends, dtype=torch.int32)], device)
    meta = InputMetadata(
        prompt_lens=prompt_lens,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        context_lens=context_lens_t,
        max_context_len=max(context_lens, default=0),
        chunk_query_start_loc=chunk_loc,
        chunk_block_tables=chunk_block_tables,
        chunk_context_lens=chunk_ends_t,
        num_chunk_tokens=sum(chunk_lens),
    )
    if seq_runs and seq_runs[0].other_block_tables:  # a hybrid model (lesson 20)
        meta.group_metas = _group_metas(meta, seq_runs, block_size, device, drafts)
    return PreparedInputs(input_ids_t, positions_t, meta, rows, sample_t, computed, chunks,
                          spec_rows)


def _group_metas(meta: InputMetadata, seq_runs: list[SequenceRun], block_size: int,
                 device: torch.device, drafts) -> list[InputMetadata]:
    """The step's metadata in each KV cache group after the first: the same batch laid out
    again from each run's table of that group (the order, lengths and rows do not depend on
    the tables), keeping only what the tables decide: slots and block tables."""
    metas = []
    for g in range(len(seq_runs[0].other_block_tables)):
        runs = [replace(r, block_table=r.other_block_tables[g], other_block_tables=())
                for r in seq_runs]
        m = prepare_inputs(runs, block_size, device, drafts).meta
        metas.append(replace(meta, slot_mapping=m.slot_mapping, block_tables=m.block_tables,
                             chunk_block_tables=m.chunk_block_tables))
    return metas


_ALIGN = 8  # bytes: every piece starts where an int64 may


def to_device_at_once(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The host ``tensors`` on ``device`` through one copy: their bytes packed into one pinned
    buffer, copied together, and cut into views of their dtypes and shapes there.

    A step's inputs are nine small tensors; on a GPU each copy of its own costs the host a few
    microseconds to launch, and the copies are most of what the host spends preparing a step.
    (On the CPU the tensors are returned as they are.)
    """
    if device.type != "cuda":
        return tensors
    host, offsets = pack(tensors, pin=True)
    return unpack(host.to(device, non_blocking=True), tensors, offsets)  # (pinned: async)


def pack(tensors: list[torch.Tensor], pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """One uint8 host buffer holding every tensor's bytes, each at a multiple of 8 bytes; and
    where each starts."""
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    host = torch.empty(max(size, _ALIGN), dtype=torch.uint8, pin_memory=pin)
    for t, start in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        host[start:start + n] = t.contiguous().view(-1).view(torch.uint8)
    return host, offsets


def unpack(buf: torch.Tensor, like: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    """Views of ``buf`` (``pack``'s buffer, wherever it is now) with ``like``'s dtypes and shapes."""
    return [buf[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, start in zip(like, offsets)]


class ModelRunner:
    """Runs the model on a prepared batch and keeps the rows that produce a next token.

    ``graph_runner`` (``worker/cuda_graphs.py``), when set, serves the decode-only steps it can
    hold from captured CUDA graphs; every other step runs eagerly here.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.graph_runner = None

    @torch.inference_mode()
    def execute_model(self, inputs: PreparedInputs, kv_caches) -> torch.Tensor:
        """Logits (R, vocab) in float32, one row per ``inputs.rows`` entry, then k + 1 rows per
        ``inputs.spec_rows`` entry."""
        if self.graph_runner is not None and self.graph_runner.can_run(inputs):
            return self.graph_runner.execute(inputs)  # decode rows are the sampled rows
        # (a step of decode tokens on the CPU: the layers' kernels called directly, the calls
        # the modules make, models/decode_plan.py; every other step: the modules)
        hidden = decode_plan.forward(self.model, inputs.input_ids, inputs.positions, kv_caches,
                                     inputs.meta)  # (T, C)
        hidden = hidden.index_select(0, inputs.sample_indices)  # (R, C)
        return self.model.compute_logits(hidden).float()  # (R, vocab)
