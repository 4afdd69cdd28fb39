"""Reference answer of lesson 10's component: the sampler's main method.

The learner's stub is ``minipaged.exercises.lesson10.MySampler``; this is one way to fill it.
Beam search stays the package's (``Sampler._beam_search``, lesson 10's exercise 2).
"""
from __future__ import annotations

import torch

from minipaged.worker.model_runner import Row
from minipaged.worker.sampler import Sampler, SequenceOutput, draw


class ReferenceSampler(Sampler):
    """Penalties, temperature, then per request: greedy, a seeded draw, or beam search."""

    def __call__(self, logits: torch.Tensor, rows: list[Row],
                 generators: dict[int, torch.Generator]) -> dict[str, dict[int, SequenceOutput]]:
        logits = self.penalized(logits, rows)  # (R, V)
        # Greedy and beam search keep temperature 1: their logprobs are the model's own.
        temperatures = torch.tensor(
            [1.0 if p.greedy or p.use_beam_search else p.temperature
             for p in (row.seq_group.sampling_params for row in rows)], device=logits.device)
        logits = logits / temperatures[:, None]
        logprobs = torch.log_softmax(logits, dim=-1)  # (R, V): what the outputs report

        by_request: dict[str, list[int]] = {}  # request id -> its rows
        for i, row in enumerate(rows):
            by_request.setdefault(row.seq_group.request_id, []).append(i)

        results: dict[str, dict[int, SequenceOutput]] = {}
        for request_id, indices in by_request.items():
            seq_group = rows[indices[0]].seq_group
            params = seq_group.sampling_params
            # {seq_id: (row within the group, parent seq id, token)}
            if params.use_beam_search:
                choices = self._beam_search(seq_group, [rows[i] for i in indices],
                                            logprobs[indices])
            else:
                choices = {}
                for k, i in enumerate(indices):
                    if params.greedy:
                        token = int(torch.argmax(logits[i]))
                        choices.update({s: (k, s, token) for s in rows[i].seq_ids})
                        continue
                    kept = self.filtered(logits[i].cpu(), params.top_k, params.top_p)  # (V,)
                    probs = torch.softmax(kept, dim=-1)
                    for seq_id in rows[i].seq_ids:  # a shared prompt row: one draw each
                        choices[seq_id] = (k, seq_id, draw(probs, generators[seq_id]))
            results[request_id] = {
                seq_id: SequenceOutput(parent, token, self.reported(
                    logprobs[indices[k]], token, params.logprobs))
                for seq_id, (k, parent, token) in choices.items()}
        return results

    @staticmethod
    def penalized(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Each row less its penalties, counted over its sequence's generated tokens only."""
        out = logits.clone()  # (R, V)
        for i, row in enumerate(rows):
            params = row.seq_group.sampling_params
            generated = row.seq_group.find(row.seq_ids[0]).output_token_ids
            if not generated or not (params.presence_penalty or params.frequency_penalty):
                continue
            counts = torch.bincount(torch.tensor(generated), minlength=logits.shape[-1])
            counts = counts.to(device=logits.device, dtype=torch.float32)  # (V,)
            out[i] = (out[i] - params.frequency_penalty * counts
                      - params.presence_penalty * (counts > 0).float())
        return out

    @staticmethod
    def filtered(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
        """One row (V,) with the tokens outside the top k and outside the nucleus at -inf."""
        if top_k != -1 and top_k < logits.shape[-1]:
            kth_best = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < kth_best, float("-inf"))
        if top_p < 1.0:
            ranked, order = torch.sort(logits, descending=True)
            probs = torch.softmax(ranked, dim=-1)
            mass_above = torch.cumsum(probs, dim=-1) - probs  # of the tokens ranked higher
            drop = mass_above >= top_p
            drop[0] = False  # the most likely token always stays
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop),
                                        float("-inf"))
        return logits

    @staticmethod
    def reported(row_logprobs: torch.Tensor, token: int, num_top: int | None) -> dict:
        """The chosen token's logprob, then the ``num_top`` most likely tokens' (if asked)."""
        reported = {token: float(row_logprobs[token])}
        if num_top:
            top = torch.topk(row_logprobs, min(num_top, row_logprobs.shape[-1]))
            for t, value in zip(top.indices.tolist(), top.values.tolist()):
                reported.setdefault(t, value)
        return reported
