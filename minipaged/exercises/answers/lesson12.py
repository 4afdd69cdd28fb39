"""Lesson 12's reference answers: the two verifications of speculative decoding.

``greedy_verify`` keeps the drafts the target's argmax agrees with and adds the target's own
next token; ``rejection_sample`` keeps a draft with probability min(1, p / q), draws the
correction from the normalised residual max(0, p - q), and a bonus token when every draft is
kept, so that what comes out is distributed exactly as the target alone would sample it.
"""
from __future__ import annotations

import torch

from minipaged.worker.sampler import draw


def greedy_verify(target_argmax_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """Accept drafts while they equal the target's choice, then add the target's own token."""
    emitted = []
    for position, draft in enumerate(draft_token_ids):
        choice = target_argmax_ids[position]  # what greedy decoding picks after the same prefix
        if draft != choice:
            return emitted + [choice]  # the correction ends the verification
        emitted.append(draft)
    return emitted + [target_argmax_ids[len(draft_token_ids)]]  # the bonus token


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int],
                     draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """Accept a prefix of the drafts and add one token; the output follows ``target_probs``."""
    k = len(draft_token_ids)
    p_rows = target_probs.double()  # (k + 1, V)
    emitted = []
    for i in range(k):
        token = draft_token_ids[i]
        p = p_rows[i]  # (V,) the target at this position
        if draft_probs is None:  # a deterministic proposer: q is all on its guess
            q = torch.zeros_like(p)  # (V,)
            q[token] = 1.0
        else:
            q = draft_probs[i].double()  # (V,)
        # keep the guess with probability min(1, p / q): u < p / q, without dividing by q
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        if u * q[token].item() < p[token].item():
            emitted.append(token)
            continue
        # rejected: the correction comes from the mass p has and q did not deliver
        residual = torch.clamp(p - q, min=0)  # (V,)
        total = residual.sum()
        residual = residual / total if total > 0 else p  # (V,) (q == p never rejects)
        emitted.append(draw(residual, generator))
        return emitted
    emitted.append(draw(p_rows[k], generator))  # every guess kept: a bonus token
    return emitted
