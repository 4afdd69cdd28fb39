"""Lesson 10's Sampler check, its diagnostics: what is wrong with the structure the learner's
``__call__`` returned, and which step of the sampler (penalties, temperature, top-k / top-p, the
draws, beam search) a wrong token or wrong logprobs point at.
"""
from __future__ import annotations

import torch

from minipaged.worker.model_runner import Row
from minipaged.worker.sampler import SequenceOutput, apply_penalties, top_k_top_p_filter


def _processed(logits, rows):
    """The package's rows after penalties and temperature (R, V)."""
    temps = [1.0 if p.greedy or p.use_beam_search else p.temperature
             for p in (r.seq_group.sampling_params for r in rows)]
    return apply_penalties(logits, rows) / torch.tensor(temps)[:, None]


def _short(value, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ...}"


def _malformed(got, shape: dict[str, list[int]]) -> str | None:
    """What is wrong with the structure the learner's ``__call__`` returned (None: nothing),
    checked before the checker reads a field of it: {request_id: {seq_id: SequenceOutput}}."""
    if not isinstance(got, dict):
        return (f"it must be a dict {{request_id: {{seq_id: SequenceOutput}}}}, not a "
                f"{type(got).__name__}")
    if sorted(got, key=repr) != sorted(shape, key=repr):
        missing = [r for r in shape if r not in got]
        extra = [r for r in got if r not in shape]
        return (f"one entry per request, keyed by its request id (row.seq_group.request_id): "
                f"missing {missing}, not expected {extra}")
    for request_id, outputs in got.items():
        if not isinstance(outputs, dict):
            return (f"the value of request {request_id!r} must be a dict {{seq_id: "
                    f"SequenceOutput}}, not a {type(outputs).__name__}")
        if sorted(outputs, key=repr) != sorted(shape[request_id], key=repr):
            return (f"request {request_id!r} needs one entry for every sequence of its rows, "
                    f"keyed by seq id ({shape[request_id]}; a fresh group's prompt row serves "
                    f"all of its seq_ids)")
        for seq_id, out in outputs.items():
            fields = [getattr(out, f, None) for f in ("parent_seq_id", "token_id", "logprobs")]
            if not isinstance(out, SequenceOutput) and None in fields:
                return (f"each value must be a SequenceOutput(parent_seq_id, token_id, "
                        f"logprobs); seq {seq_id}'s is a {type(out).__name__}")
            parent, token, logprobs = fields
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (parent, token)):
                return (f"seq {seq_id}'s parent_seq_id and token_id must be plain ints (int(...) "
                        f"of a tensor), not {type(parent).__name__} and {type(token).__name__}")
            if not isinstance(logprobs, dict) or not all(
                    isinstance(t, int) and isinstance(v, float) for t, v in logprobs.items()):
                return (f"seq {seq_id}'s logprobs must be a dict {{token id (int): logprob "
                        f"(float)}}, the chosen token's first")
    return None


_GENERATOR_HINT = ("a random row draws with its own sequence's generator, generators[seq_id], "
                   "exactly one number per token (draw does that); never torch's global one")
_LOGPROB_HINT = ("report log_softmax of the logits after the penalties and the temperature (1 "
                 "for greedy and beam search), before top-k and top-p; logprobs=n adds the n most "
                 "likely tokens' logprobs to the chosen one's")


def _generator_hint(row: Row) -> str:
    if len(row.seq_ids) > 1:
        return ("a fresh group's prompt row serves all of its seq_ids: each of its sequences "
                "draws its own token, with its own generator (one draw(probs, "
                "generators[seq_id]) per seq_id), so n samples can differ")
    return _GENERATOR_HINT


def _logprob_hint(row: Row, rows: list[Row], logits: torch.Tensor, reported: dict) -> str:
    """Which step of the pipeline the learner's reported logprobs skipped or added: they are
    compared with the logprobs each usual slip gives."""
    params = row.seq_group.sampling_params
    seq = row.seq_group.find(row.seq_ids[0])
    base = logits[rows.index(row)]  # (V,)
    temperature = 1.0 if params.greedy or params.use_beam_search else params.temperature

    def penalised(tokens: list[int]) -> torch.Tensor:  # (V,)
        if not tokens:
            return base
        counts = torch.bincount(torch.tensor(tokens), minlength=base.shape[-1]).float()
        return (base - params.frequency_penalty * counts
                - params.presence_penalty * (counts > 0).float())

    right = penalised(seq.output_token_ids) / temperature  # (V,)
    values = torch.log_softmax(right, dim=-1)  # (V,)
    if params.logprobs and len(reported) < params.logprobs + 1 and all(
            isinstance(t, int) and 0 <= t < values.shape[-1]
            and abs(float(values[t]) - v) <= 1e-4 for t, v in reported.items()):
        return (f"the right values, too few of them: logprobs={params.logprobs} asks for the "
                f"chosen token's logprob AND those of the {params.logprobs} most likely tokens "
                f"(torch.topk of the row's logprobs)")
    slips = [
        (penalised(seq.get_token_ids()) / temperature,
         "the penalties count the sequence's generated tokens only (output_token_ids), never "
         "the prompt's"),
        (base / temperature, "the presence and frequency penalties come first: the token is "
                             "chosen, and the logprobs reported, from the penalised logits"),
        (penalised(seq.output_token_ids), "the reported logprobs are those after the "
                                          "temperature too (logits / temperature)"),
        (top_k_top_p_filter(right.clone(), params.top_k, params.top_p),
         "the reported logprobs are taken BEFORE top-k and top-p: the filters choose what may "
         "be drawn, the logprobs stay those of the whole vocabulary"),
    ]
    for slipped, hint in slips:
        values = torch.log_softmax(slipped, dim=-1)  # (V,)
        if all(isinstance(t, int) and 0 <= t < values.shape[-1]
               and abs(float(values[t]) - v) <= 1e-4 for t, v in reported.items()):
            return hint
    return _LOGPROB_HINT


def _token_hint(row, rows, logits, token, mine, theirs, seq_id) -> str:
    params = row.seq_group.sampling_params
    if params.use_beam_search:
        return ("a beam-search group goes to self._beam_search(seq_group, its rows, their "
                "logprobs), all its rows at once, at temperature 1")
    processed = _processed(logits, rows)[rows.index(row)]  # (V,)
    if params.greedy:
        return ("a greedy row takes the argmax of its logits after the presence and frequency "
                "penalties (counted over the generated tokens only, never the prompt)")
    if not torch.equal(mine[seq_id].get_state(), theirs[seq_id].get_state()):
        return _generator_hint(row)
    if not 0 <= token < processed.shape[-1] or torch.isinf(
            top_k_top_p_filter(processed, params.top_k, params.top_p)[token]):
        if 0 <= token < processed.shape[-1] and torch.isfinite(
                top_k_top_p_filter(processed, params.top_k, 1.0)[token]):
            return (f"token {token} is outside the nucleus: top-p keeps the most likely tokens "
                    f"until their running sum reaches top_p (the token that reaches it stays), "
                    f"and drops every token after it")
        return f"token {token} is not among the top_k most likely: it has probability 0"
    return ("penalties, then the temperature, then top-k and top-p on that row, a softmax, and "
            "one draw(probs, generators[seq_id]) for each of the row's sequences")
