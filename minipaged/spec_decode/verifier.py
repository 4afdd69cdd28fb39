"""From the target's k + 1 rows of logits to the tokens a verification emits (lesson 12).

Each of a ``SpecRow``'s k + 1 rows is processed as the sampler would process a plain decode step
at that position: penalties over the tokens generated *before* that position (the accepted
drafts included), temperature, logprobs, and for sampled requests top-k and top-p. Then
``greedy_verify`` or ``rejection_sample`` decides how many drafts are kept, and each emitted
token carries the logprobs of the row it came from, exactly as without speculation.
"""
from __future__ import annotations

import torch

from minipaged.spec_decode.rejection_sampler import greedy_verify, rejection_sample
from minipaged.worker.model_runner import SpecRow
from minipaged.worker.sampler import SequenceOutput, penalize, top_k_top_p_filter


def _penalised(logits: torch.Tensor, output: list[int], draft: list[int], params) -> torch.Tensor:
    """Presence and frequency penalties for rows (k + 1, V): row i sees ``output + draft[:i]``."""
    if not params.presence_penalty and not params.frequency_penalty:
        return logits
    rows, vocab = logits.shape
    counts = torch.zeros(rows, vocab, device=logits.device)  # (k + 1, V)
    if output:
        counts.index_add_(1, torch.tensor(output, device=logits.device),
                          torch.ones(rows, len(output), device=logits.device))
    for i, token in enumerate(draft):
        counts[i + 1:, token] += 1  # the drafts before each later position
    return penalize(logits, counts, params.presence_penalty, params.frequency_penalty)


def verify(logits: torch.Tensor, spec_rows: list[SpecRow],
           generators: dict[int, torch.Generator],
           draft_probs: dict[int, torch.Tensor | None]) -> dict[int, list[SequenceOutput]]:
    """The emitted tokens (1 to k + 1) of every verified sequence, by sequence id.

    Args:
        logits: (sum of k + 1 over the rows, V) the target's logits, row after row.
        spec_rows: the step's verifications, in the order of their logits.
        generators: one random generator per sequence id.
        draft_probs: per sequence id the proposer's distributions (k, V), or None when the
            proposer is deterministic (n-gram) or the request is greedy.
    """
    results: dict[int, list[SequenceOutput]] = {}
    offset = 0
    for row in spec_rows:
        k = len(row.draft_token_ids)
        params = row.seq_group.sampling_params
        seq = row.seq_group.find(row.seq_id)
        rows = _penalised(logits[offset:offset + k + 1], seq.output_token_ids,
                          row.draft_token_ids, params)  # (k + 1, V)
        offset += k + 1
        if not params.greedy:
            rows = rows / params.temperature
        logprobs = torch.log_softmax(rows, dim=-1)  # (k + 1, V)
        if params.greedy:
            emitted = greedy_verify(torch.argmax(rows, dim=-1).tolist(),
                                    list(row.draft_token_ids))  # (a copy: counted after)
        else:
            host = rows.cpu()
            probs = torch.stack([torch.softmax(top_k_top_p_filter(host[i], params.top_k,
                                                                  params.top_p), dim=-1)
                                 for i in range(k + 1)])  # (k + 1, V)
            emitted = rejection_sample(probs, list(row.draft_token_ids),
                                       draft_probs.get(row.seq_id), generators[row.seq_id])
        positions = torch.arange(len(emitted), device=logprobs.device)
        chosen = logprobs[positions, torch.tensor(emitted, device=logprobs.device)].tolist()
        num_top = min(params.logprobs or 0, logprobs.shape[-1])
        top = torch.topk(logprobs[:len(emitted)], num_top, dim=-1) if num_top else None
        outs = []
        for j, token in enumerate(emitted):
            lp = {token: chosen[j]}
            if top is not None:
                for t, v in zip(top.indices[j].tolist(), top.values[j].tolist()):
                    lp.setdefault(t, v)
            outs.append(SequenceOutput(row.seq_id, token, lp))
        results[row.seq_id] = outs
    return results
