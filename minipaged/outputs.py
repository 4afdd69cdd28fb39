"""What ``LLM.generate`` returns (vLLM v0.1 names)."""
from __future__ import annotations

from dataclasses import dataclass, field

from minipaged.sequence import SequenceGroup, SequenceStatus


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = field(default=None)  # why the engine aborted the request, if it did

    @classmethod
    def from_seq_group(cls, seq_group: SequenceGroup) -> RequestOutput:
        params = seq_group.sampling_params
        seqs = seq_group.get_seqs()
        if params.use_beam_search or params.best_of > params.n:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)
        outputs = [
            CompletionOutput(
                index=i,
                text=seq.output_text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
                finish_reason=SequenceStatus.get_finished_reason(seq.status),
            )
            for i, seq in enumerate(seqs[: params.n])
        ]
        return cls(seq_group.request_id, seq_group.prompt, list(seq_group.prompt_token_ids),
                   outputs, seq_group.is_finished(), seq_group.error)
