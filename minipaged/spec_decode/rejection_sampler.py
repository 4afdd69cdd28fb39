"""Verifying proposed tokens so that the output is exactly the target model's (lesson 12).

A proposer guesses ``k`` tokens ``d1..dk``; the target model scores all of them in one forward
pass and gives ``k + 1`` distributions: row ``i`` is the target's distribution for the token at
draft position ``i`` (having seen the drafts before it), row ``k`` the one after all ``k`` drafts.

- Greedy (``greedy_verify``): keep drafts while they equal the target's argmax; the first
  mismatch is replaced by the target's own token. The result is token for token what plain
  greedy decoding would produce.
- Sampling (``rejection_sample``): keep draft ``di`` with probability ``min(1, p(di) / q(di))``
  (``p`` the target's, ``q`` the proposer's distribution); at the first rejection draw the
  correction from the *residual* ``max(0, p - q)`` normalised. If all ``k`` are kept, draw a
  bonus token from row ``k``. Every emitted token is then distributed exactly as the target
  alone would have sampled it.

Both return the emitted tokens: the accepted prefix of the drafts, then exactly one more token,
so between 1 and ``k + 1`` tokens per verification.
"""
from __future__ import annotations

import torch

from minipaged.worker.sampler import draw


def greedy_verify(target_argmax_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """Accept drafts while they equal the target's choice, then add the target's own token.

    Args:
        target_argmax_ids: ``k + 1`` ids, the target's argmax at each draft position and after
            the last draft.
        draft_token_ids: the ``k`` proposed ids.
    """
    if len(target_argmax_ids) != len(draft_token_ids) + 1:
        raise ValueError(f"target_argmax_ids: expected {len(draft_token_ids) + 1} ids "
                         f"(k + 1), got {len(target_argmax_ids)}")
    emitted = []
    for target, draft in zip(target_argmax_ids, draft_token_ids):
        if target != draft:
            emitted.append(target)  # the correction: what greedy decoding picks here
            return emitted
        emitted.append(draft)
    emitted.append(target_argmax_ids[-1])  # the bonus token: all k drafts were right
    return emitted


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q)`` normalised to sum 1: where to draw after a draft was rejected.

    ``p``, ``q``: (V,) probability vectors. NOTE: when ``p == q`` everywhere the residual is all
    zeros; that case never needs it (a draft from ``q == p`` is accepted with probability 1),
    so ``p`` itself is returned rather than dividing by zero.
    """
    residual = torch.clamp(p - q, min=0)  # (V,)
    total = residual.sum()
    if total <= 0:
        return p
    return residual / total


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int],
                     draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """Accept a prefix of the drafts and add one token; the output follows ``target_probs``.

    Args:
        target_probs: (k + 1, V) the target's probabilities at each draft position and after
            the last draft (after temperature, top-k, top-p).
        draft_token_ids: the ``k`` proposed ids.
        draft_probs: (k, V) the proposer's distributions, or ``None`` for a deterministic
            proposer (n-gram lookup): then ``q`` is one-hot at the draft, a draft is kept with
            probability ``p(draft)``, and the residual is ``p`` without the draft, renormalised.
        generator: the sequence's random generator (``None``: torch's global one).

    NOTE: the random numbers are drawn in a fixed order (one uniform per examined draft, then
    one for the last token), so a seeded sequence gives the same tokens in any batch.
    """
    k = len(draft_token_ids)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs: expected {k + 1} rows (k + 1), "
                         f"got {target_probs.shape[0]}")
    if draft_probs is not None and draft_probs.shape[0] != k:
        raise ValueError(f"draft_probs: expected {k} rows (k), got {draft_probs.shape[0]}")
    target_probs = target_probs.double()
    emitted = []
    for i, token in enumerate(draft_token_ids):
        p = target_probs[i]  # (V,)
        if draft_probs is None:
            q = torch.zeros_like(p)  # (V,) one-hot at the draft
            q[token] = 1.0
        else:
            q = draft_probs[i].double()  # (V,)
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        # accept with probability min(1, p/q), written without dividing by q
        if u * float(q[token]) < float(p[token]):
            emitted.append(token)
            continue
        emitted.append(draw(residual_distribution(p, q), generator))
        return emitted
    emitted.append(draw(target_probs[k], generator))  # the bonus token
    return emitted
