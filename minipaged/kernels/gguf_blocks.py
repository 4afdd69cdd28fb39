"""GGUF's block formats: how a file stores a weight matrix, and its dequantization in torch.

A GGUF file stores each row of a weight matrix as consecutive blocks; a block holds a few scales
and the small integer codes of its weights. The formats minipaged reads:

=======  =========  ======  ==========================================================
format   weights    bytes   a weight
=======  =========  ======  ==========================================================
Q8_0     32         34      ``d * q``, d float16, q int8
Q4_1     32         20      ``d * q + m``, d and m float16, q 4 bits (low nibbles are
                            codes 0-15, high nibbles codes 16-31)
Q5_0     32         22      ``d * (q - 16)``, d float16, q 5 bits: 4 in nibbles as Q4_1's,
                            the fifth of weight j bit j of a 32-bit word
Q4_K     256        144     8 sub-blocks of 32: ``(d * sc) * q - (dmin * mn)``, sc and mn
                            6 bits each (packed in 12 bytes), q 4 bits
Q6_K     256        210     16 sub-blocks of 16: ``(d * sc) * q``, sc int8, q 6 bits
                            (4 low bits, 2 high bits elsewhere) minus 32
=======  =========  ======  ==========================================================

The embedded SmolLM2 is Q4_1 (its layers) and Q8_0 (its embedding, also its output layer);
Gemma 3 270M's Q4_K_M mixes Q5_0 (q, k, gate, up), Q8_0 (v, some down, the embedding),
Q4_K and Q6_K. Every ``dequantize_*`` below computes, in
float32, the same operations in the same order as the ``gguf`` package's reference (which
transformers' GGUF loader uses), so its values equal the reference's bit for bit
(tests/kernels/test_gguf_blocks.py). ``models/gguf_linear.py`` multiplies by them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # the number a GGUF file writes for the format
    weights: int  # weights per block
    bytes: int  # bytes per block
    function: str  # its dequantization here: (n, bytes) uint8 -> (n, weights) float32

    @property
    def dequantize(self) -> Callable[[torch.Tensor], torch.Tensor]:
        # looked up by name at each call: lesson 18 puts the learner's Q4_1 in its place
        # (exercises/workbench.plugged_in)
        return globals()[self.function]


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block, as float32 (n, 1)."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(codes: torch.Tensor, groups: int) -> torch.Tensor:
    """Each group of bytes' low 4 bits, then its high 4 bits: (n, groups, 2 * bytes per group)."""
    g = codes.reshape(codes.shape[0], groups, -1)
    return torch.cat([g & 0x0F, g >> 4], dim=-1)


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks, 0)
    return blocks[:, 2:].contiguous().view(torch.int8).float() * d


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _half(blocks, 0), _half(blocks, 2)
    q = _nibbles(blocks[:, 4:], 1).reshape(blocks.shape[0], 32).float()
    return (d * q) + m


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _half(blocks, 0)
    # bit j of the little-endian 32-bit word at byte 2 is weight j's fifth: bit j % 8 of byte j // 8
    high = blocks[:, 2:6].repeat_interleave(8, dim=1) >> (torch.arange(32) % 8).to(torch.uint8)
    high = high & 1  # (n, 32)
    low = _nibbles(blocks[:, 6:], 1).reshape(n, 32)
    q = (low | (high << 4)).view(torch.int8) - 16
    return d * q.float()


def _q4_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 8 scales and 8 mins, 6 bits each, out of 12 bytes (n, 12) -> (n, 8), (n, 8).

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the high 2 bits of scales 4-7; bytes 4-7 the
    same for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7."""
    d, m, both = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([d & 0x3F, (both & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (both >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales, mins


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    scales, mins = _q4_k_scales(blocks[:, 4:16])
    d = (d * scales.float()).reshape(n, 8, 1)
    dm = (dmin * mins.float()).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 16:], 4).reshape(n, 8, 32).float()  # 4 groups of 32 bytes
    return (d * q - dm).reshape(n, 256)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low, high = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_half(blocks, 208) * scales).reshape(n, 16, 1)
    low = _nibbles(low, 2).reshape(n, 2, 2, 64)  # per half: low nibbles of 64 bytes, then high
    low = low.reshape(n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = (high.reshape(n, 2, 1, 32) >> shifts) & 0x03  # per half: 4 groups of 32 from 32 bytes
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, 256)


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q8_0", 8, 32, 34, "dequantize_q8_0"),
    BlockFormat("Q4_1", 3, 32, 20, "dequantize_q4_1"),
    BlockFormat("Q5_0", 6, 32, 22, "dequantize_q5_0"),
    BlockFormat("Q4_K", 12, 256, 144, "dequantize_q4_k"),
    BlockFormat("Q6_K", 14, 256, 210, "dequantize_q6_k"),
)}
UNQUANTIZED = ("F32", "F16")  # read as they are (norms, biases)


def block_format(name: str) -> BlockFormat:
    """The format called ``name``, or a ValueError naming the formats minipaged reads."""
    if name not in FORMATS:
        raise ValueError(f"GGUF block format {name} is not supported: minipaged reads "
                         f"{', '.join(FORMATS)} (and unquantized {', '.join(UNQUANTIZED)})")
    return FORMATS[name]


def dequantize(rows: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """A matrix's rows of blocks, uint8 (rows, bytes per row), as float32 (rows, in features)."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] % fmt.bytes:
        raise ValueError(f"{fmt.name} rows must be uint8 (rows, a multiple of {fmt.bytes} "
                         f"bytes), got {rows.dtype} {tuple(rows.shape)}")
    n = rows.shape[0]
    blocks = rows.reshape(-1, fmt.bytes)
    return fmt.dequantize(blocks).reshape(n, -1)
