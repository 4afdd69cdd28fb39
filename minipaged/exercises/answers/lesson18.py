"""Lesson 18's reference answer: a GGUF Q4_1 block's 32 weights, ``d * code + m``.

The learner's stub is the lesson's ``dequantize_q4_1`` cell; this is one way to fill it.
"""
from __future__ import annotations

import torch


def dequantize_q4_1(blocks):
    """uint8 (n, 20) Q4_1 blocks -> float32 (n, 32) weights."""
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # (n, 1) the scale
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()  # (n, 1) the min
    codes = blocks[:, 4:]  # (n, 16): two 4-bit codes a byte
    q = torch.cat([codes & 0x0F, codes >> 4], dim=1).float()  # weights 0-15, then 16-31
    return d * q + m
