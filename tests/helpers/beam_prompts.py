"""Prompts whose beam search is well defined on a random tiny model (lesson 03).

Random tiny models have near-ties, so a prompt is kept only where a float64 beam search has a
clear gap at every step between the k-th and (k+1)-th candidate and between the final beams: then
the kept set and the final order are well defined, and any correct float32 implementation must
find them. Shared by the beam-search, swapping and robustness tests.
"""
from __future__ import annotations

import copy
import random

import torch

from tiny_models import VOCAB

NEW_TOKENS = 8
PROMPT_LENS = [5, 11]  # the second spans several blocks of 4
MIN_GAP = 1e-3


@torch.no_grad()
def beam_search64(model64, prompt: list[int], width: int, steps: int):
    """Plain beam search in float64. Returns (beams best first as (score, tokens), min gap)."""
    beams = [(0.0, [])]
    gap = float("inf")
    for _ in range(steps):
        ids = torch.tensor([prompt + tokens for _, tokens in beams])
        logprobs = torch.log_softmax(model64(ids).logits[:, -1], dim=-1)  # (beams, V)
        candidates = []
        for (score, tokens), row in zip(beams, logprobs):
            top = torch.topk(row, width + 1)
            candidates += [(score + float(v), tokens + [int(t)])
                           for v, t in zip(top.values, top.indices)]
        candidates.sort(key=lambda c: c[0], reverse=True)
        gap = min(gap, candidates[width - 1][0] - candidates[width][0])
        beams = candidates[:width]
    gap = min([gap] + [beams[i][0] - beams[i + 1][0] for i in range(width - 1)])
    return beams, gap


def pick_beam_prompts(model, width: int, seed: int, lengths=tuple(PROMPT_LENS),
                      steps: int = NEW_TOKENS, tries: int = 60):
    """One prompt per entry of ``lengths`` whose float64 beam search has no near-tie.

    Returns [(prompt, float64 beams best first as (score, tokens))]."""
    model64 = copy.deepcopy(model).double()
    rng = random.Random(seed)
    picked = []
    for length in lengths:
        for _ in range(tries):
            prompt = [rng.randrange(2, VOCAB) for _ in range(length)]
            beams, gap = beam_search64(model64, prompt, width, steps)
            if gap >= MIN_GAP:
                picked.append((prompt, beams))
                break
        else:
            raise AssertionError(f"no prompt of length {length} without near-ties (k={width})")
    return picked
