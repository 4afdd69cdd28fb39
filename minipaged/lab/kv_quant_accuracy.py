"""How much an 8-bit KV cache changes a model's answers (lesson 18, ``benchmarks/kv_quant.py``).

- ``cached_vectors``: the keys and values an engine's cache holds, as (vectors, head_size);
- ``scale_choice_error``: the relative error of one scale per tensor against one per token and
  kv head, on those vectors;
- ``teacher_forced_logprobs``: the log-probability an engine gives each next token of a fixed
  text, the whole text in one prefill (an 8-bit cache's prompt attends to its keys and values as
  the cache holds them, so this measures the quantized cache);
- ``greedy_agreement``: how many leading tokens two greedy outputs share.
"""
from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from minipaged.kernels import kv_quant
from minipaged.lab.batch_inputs import prepare_inputs_for_groups
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = itertools.count(10**9)  # sequence ids of our own, far from the engine's


def cached_vectors(llm, layer: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the first ``num_blocks`` blocks of a 16/32-bit cache's ``layer``.

    Args:
        llm: an ``LLM`` with ``kv_cache_dtype="auto"`` that has generated something.
        layer: which layer.
        num_blocks: how many blocks to read (all-zero vectors, never written, are dropped).

    Returns:
        keys, values: (vectors, head_size) float32 each.
    """
    key_cache, value_cache = llm.llm_engine.worker.cache_engine.gpu_cache[layer][:2]
    k = key_cache[:num_blocks].float()  # (B, kv_heads, D/x, bs, x)
    k = k.permute(0, 3, 1, 2, 4).reshape(-1, value_cache.shape[2])  # (B*bs*kv_heads, D)
    v = value_cache[:num_blocks].float().permute(0, 3, 1, 2)  # (B, bs, kv_heads, D)
    v = v.reshape(-1, value_cache.shape[2])  # (B*bs*kv_heads, D)
    written = k.abs().amax(-1) > 0  # (N,)
    return k[written], v[written]


def scale_choice_error(x: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    """Relative RMS error ``|x' - x| / |x|`` of two scale choices for 8-bit ``dtype``.

    Args:
        x: (vectors, head_size) real keys or values.
        dtype: ``torch.float8_e4m3fn`` or ``torch.int8``.

    Returns:
        {"per tensor": ..., "per token and head": ...}; "per tensor" is one scale for all of
        ``x``, its largest magnitude (calibrated on the very data, its best case).
    """
    qmax = kv_quant.QMAX[dtype]
    scale = x.abs().amax() / qmax
    y = (x / scale).clamp(-qmax, qmax)
    y = torch.round(y) if dtype == torch.int8 else y
    per_tensor = y.to(dtype).float() * scale
    per_token = kv_quant.round_trip(x, dtype)
    norm = x.norm()
    return {"per tensor": float((per_tensor - x).norm() / norm),
            "per token and head": float((per_token - x).norm() / norm)}


@torch.no_grad()
def teacher_forced_logprobs(llm, token_ids: list[int]) -> torch.Tensor:
    """log p(token_ids[t + 1] | token_ids[:t + 1]) for every t, from one prefill of the text.

    Args:
        llm: an ``LLM`` (one process, idle: its blocks are borrowed for this pass).
        token_ids: the text, at most the engine's ``max_model_len`` tokens.

    Returns:
        (len(token_ids) - 1,) float32.
    """
    engine = llm.llm_engine
    seq = Sequence(next(_ids), None, token_ids, engine.block_size)
    group = SequenceGroup(f"teacher-{seq.seq_id}", [seq], SamplingParams(max_tokens=1),
                          time.time())
    engine.block_manager.allocate(group)
    seq.status = SequenceStatus.RUNNING
    try:
        inputs = prepare_inputs_for_groups([group], engine.block_manager, engine.block_size,
                                           engine.worker.device)
        every_row = torch.arange(len(token_ids), device=engine.worker.device)  # (T,)
        logits = engine.worker.execute_model(dataclasses.replace(inputs,
                                                                 sample_indices=every_row))
    finally:
        engine.block_manager.free(seq)
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # (T-1, vocab)
    nxt = torch.tensor(token_ids[1:], device=logprobs.device)  # (T-1,)
    return logprobs.gather(1, nxt[:, None])[:, 0].cpu()


def greedy_agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
