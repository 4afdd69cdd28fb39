"""Sequences, sequence groups and their states (lessons 02 and 04).

A ``Sequence`` is one stream of tokens (prompt + generated) with its logical token blocks. A
``SequenceGroup`` is everything generated for one request: one sequence for plain sampling,
``best_of`` sequences for parallel sampling and beam search, all sharing the prompt.
"""
from __future__ import annotations

import enum

from minipaged.block import LogicalTokenBlock
from minipaged.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # in the waiting queue: no KV blocks yet (or freed by recompute)
    RUNNING = enum.auto()  # has GPU blocks and is scheduled every step
    SWAPPED = enum.auto()  # its blocks were moved to CPU memory
    FINISHED_STOPPED = enum.auto()  # EOS or a stop string
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or the model's maximum length
    FINISHED_ABORTED = enum.auto()  # abort_request, or a request that can never run
    FINISHED_IGNORED = enum.auto()  # dropped by a beam-search step

    @staticmethod
    def is_finished(status: SequenceStatus) -> bool:
        # (identity tests: asked several times per sequence and step, and an enum member's
        # hash, which a set lookup needs, is a Python call)
        return not (status is _WAITING or status is _RUNNING or status is _SWAPPED)

    @staticmethod
    def get_finished_reason(status: SequenceStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_WAITING, _RUNNING, _SWAPPED = (SequenceStatus.WAITING, SequenceStatus.RUNNING,
                                SequenceStatus.SWAPPED)
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}


class Sequence:
    """The tokens of one sequence, cut into logical blocks of ``block_size`` tokens."""

    def __init__(self, seq_id: int, prompt: str | None, prompt_token_ids: list[int],
                 block_size: int) -> None:
        self.seq_id = seq_id
        self.prompt = prompt
        self.block_size = block_size
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []  # per generated token
        self.cumulative_logprob = 0.0
        self.output_text = ""
        self.prefix_offset = 0  # detokenizer window: output_token_ids[prefix_offset:read_offset]
        self.read_offset = 0  # is already in output_text (see detokenizer.py)
        self.logical_token_blocks: list[LogicalTokenBlock] = []
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V are in the cache. After a preemption by recompute it drops to 0, and
        # the next run computes every token again as one "prompt".
        self.num_computed_tokens = 0
        # Speculative decoding (lesson 12): slots reserved this step after the newest token,
        # for the proposed tokens the target verifies; 0 outside a speculative step.
        self.num_lookahead_slots = 0
        self._append_tokens_to_blocks(self.prompt_token_ids)

    def _append_tokens_to_blocks(self, token_ids: list[int]) -> None:
        i = 0
        while i < len(token_ids):
            if not self.logical_token_blocks or self.logical_token_blocks[-1].is_full():
                self.logical_token_blocks.append(
                    LogicalTokenBlock(len(self.logical_token_blocks), self.block_size))
            last = self.logical_token_blocks[-1]
            n = last.get_num_empty_slots()
            last.append_tokens(token_ids[i:i + n])
            i += n

    def append_token_id(self, token_id: int, logprobs: dict[int, float]) -> None:
        """Add a generated token; ``logprobs`` must contain the chosen token's logprob."""
        self._append_tokens_to_blocks([token_id])
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprobs)
        self.cumulative_logprob += logprobs[token_id]

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_last_token_id(self) -> int:
        if self.output_token_ids:
            return self.output_token_ids[-1]
        return self.prompt_token_ids[-1]

    def is_finished(self) -> bool:
        status = self.status
        return not (status is _WAITING or status is _RUNNING or status is _SWAPPED)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the cache is gone, every token will be computed again."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def copy_state_from(self, parent: Sequence) -> None:
        """Become a copy of ``parent`` (beam search: a dropped beam is reused for a new child)."""
        self.output_token_ids = list(parent.output_token_ids)
        self.output_logprobs = list(parent.output_logprobs)
        self.cumulative_logprob = parent.cumulative_logprob
        self.output_text = parent.output_text
        self.prefix_offset, self.read_offset = parent.prefix_offset, parent.read_offset
        self.logical_token_blocks = [b.copy() for b in parent.logical_token_blocks]
        self.num_computed_tokens = parent.num_computed_tokens

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
                f"num_blocks={len(self.logical_token_blocks)}, len={self.get_len()})")


class SequenceGroup:
    """The sequences generated for one request, sharing its prompt and sampling settings."""

    def __init__(self, request_id: str, seqs: list[Sequence], sampling_params: SamplingParams,
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.seqs = seqs
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.error: str | None = None  # set when the engine had to abort the request itself
        # Prefill work admitted but not run yet (see scheduler.PrefillChunk). While it is not
        # empty the group's sequences wait; they decode together once every chunk has run.
        self.pending_chunks: list = []

    @property
    def prompt(self) -> str | None:
        return self.seqs[0].prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [seq for seq in self.seqs if seq.status == status]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def get_max_num_running_seqs(self) -> int:
        """The most sequences this group will run at once from now on."""
        if self.sampling_params.use_beam_search:
            return self.sampling_params.best_of
        return sum(not seq.is_finished() for seq in self.seqs)

    def find(self, seq_id: int) -> Sequence:
        for seq in self.seqs:
            if seq.seq_id == seq_id:
                return seq
        raise ValueError(f"sequence {seq_id} is not in request {self.request_id}")

    def is_finished(self) -> bool:
        for seq in self.seqs:
            if not seq.is_finished():
                return False
        return True

    def is_prompt(self) -> bool:
        """True while some unfinished sequence still needs its tokens computed (a prefill run)."""
        return bool(self.pending_chunks) or any(
            s.num_computed_tokens == 0 for s in self.seqs if not s.is_finished())

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id}, num_seqs={len(self.seqs)})"
