"""Watching the engine's sampler at work (lesson 10): the logits it gets and what it returns.

    probe = SamplerProbe(llm.llm_engine)   # stands in for engine.sampler and calls the real one
    llm.generate(...)
    probe.calls[0].logits                  # (rows, vocab): the model's next-token logits
    probe.detach()                         # the engine's own sampler again

``sampler_logprobs`` runs the real ``Sampler`` on one row of logits with the settings you give,
and ``beam_candidates`` lays one recorded beam-search step out as plain data for a drawing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup
from minipaged.worker.model_runner import Row
from minipaged.worker.sampler import Sampler, SequenceOutput, apply_penalties


@dataclass
class SamplerCall:
    """One call of the engine's sampler, copied at the time of the call."""

    logits: torch.Tensor  # (R, V) as the model returned them
    penalized: torch.Tensor  # (R, V) after the presence and frequency penalties
    request_ids: list[str]  # per row
    seq_ids: list[list[int]]  # per row: the sequences that continue from it
    output_token_ids: list[list[int]]  # per row: what its (first) sequence had generated
    cumulative_logprobs: list[float]  # per row: its (first) sequence's, before this step
    outputs: dict[str, dict[int, SequenceOutput]]  # what the sampler returned


class SamplerProbe:
    """Stands in for ``engine.sampler``: records every call, and lets the real sampler answer."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.sampler = engine.sampler
        self.calls: list[SamplerCall] = []
        engine.sampler = self

    def __call__(self, logits: torch.Tensor, rows: list[Row],
                 generators: dict[int, torch.Generator]):
        seqs = [row.seq_group.find(row.seq_ids[0]) for row in rows]
        record = SamplerCall(
            logits=logits.detach().cpu().clone(),
            penalized=apply_penalties(logits, rows).detach().cpu().clone(),
            request_ids=[row.seq_group.request_id for row in rows],
            seq_ids=[list(row.seq_ids) for row in rows],
            output_token_ids=[list(seq.output_token_ids) for seq in seqs],
            cumulative_logprobs=[seq.cumulative_logprob for seq in seqs], outputs={})
        record.outputs = self.sampler(logits, rows, generators)
        self.calls.append(record)
        return record.outputs

    def detach(self) -> None:
        self.engine.sampler = self.sampler

    def calls_of(self, request_id: str) -> list[SamplerCall]:
        """The calls that had a row of ``request_id``, in step order."""
        return [call for call in self.calls if request_id in call.request_ids]


def sampler_logprobs(logits: torch.Tensor, params: SamplingParams,
                     num_top: int) -> dict[int, float]:
    """The real ``Sampler`` on one row of logits (V,): the ``num_top`` most likely tokens and
    their logprobs under ``params`` (after penalties and temperature, before top-k and top-p, as
    the engine returns them)."""
    params = SamplingParams(**_with_logprobs(params, num_top))
    group = SequenceGroup("probe", [Sequence(0, None, [0], 16)], params, arrival_time=0.0)
    generator = torch.Generator().manual_seed(0)
    out = Sampler()(logits[None], [Row(group, [0], True)], {0: generator})  # one row: (1, V)
    logprobs = out["probe"][0].logprobs
    top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:num_top]
    return dict(top)


def _with_logprobs(params: SamplingParams, num_top: int) -> dict:
    fields = ("presence_penalty", "frequency_penalty", "temperature", "top_p", "top_k",
              "max_tokens", "seed")
    return {**{name: getattr(params, name) for name in fields}, "logprobs": num_top}


def beam_candidates(call: SamplerCall, request_id: str, per_beam: int) -> list[dict]:
    """One beam-search step of ``request_id``, as plain data: one entry per live beam (row)
    with its generated tokens, its cumulative logprob and its ``per_beam`` best next tokens.

    Each candidate has ``token``, ``logprob`` (beam search uses temperature 1), ``score``
    (the beam's cumulative logprob + the token's), and ``kept_as``: the sequence id that
    continues it after this step, or None when the sampler dropped it.
    """
    rows = [i for i, rid in enumerate(call.request_ids) if rid == request_id]
    kept = {(out.parent_seq_id, out.token_id): seq_id
            for seq_id, out in call.outputs[request_id].items()}
    logprobs = torch.log_softmax(call.penalized[rows], dim=-1)  # (beams, V)
    beams = []
    for k, i in enumerate(rows):
        top = torch.topk(logprobs[k], per_beam)
        cum = call.cumulative_logprobs[i]
        parent = call.seq_ids[i][0]
        first_step = len(call.seq_ids[i]) > 1  # the prompt row, shared by every beam
        candidates = []
        for token, lp in zip(top.indices.tolist(), top.values.tolist()):
            if first_step:  # each kept token continues one of the identical copies
                kept_as = next((s for (p, t), s in kept.items() if t == token), None)
            else:
                kept_as = kept.get((parent, token))
            candidates.append({"token": token, "logprob": lp, "score": cum + lp,
                               "kept_as": kept_as})
        beams.append({"seq_id": parent, "output_token_ids": call.output_token_ids[i],
                      "cumulative_logprob": cum, "candidates": candidates})
    return beams
