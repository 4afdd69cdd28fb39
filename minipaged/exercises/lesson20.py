"""Lesson 20 exercise: Qwen3's step between the projections and the rotation.

    qwen3_queries_keys(attn, positions, q, k) -> (q, k)
        attn: one layer's attention of our model (``models/llama.py``, ``LlamaAttention``):
            attn.num_heads, attn.num_kv_heads, attn.head_size; attn.q_norm and attn.k_norm,
            RMSNorm modules whose weight has head_size numbers; attn.rotary(positions, q, k),
            which rotates (T, heads, head_size) queries and keys.
        positions: (T,) each token's position.
        q: (T, num_heads * head_size) the queries as q_proj made them; k: (T, num_kv_heads *
            head_size) the keys.
        Returns the queries and keys the paged attention reads: each head's query normed by
        q_norm and each head's key by k_norm (over that head's head_size numbers), then both
        rotated. Any shape with T rows in this order ((T, H, D) or (T, H * D)).

The check runs the learner's function on random tensors next to the package's step, then
plugs it into our model on a tiny random Qwen3 checkpoint saved with transformers, and compares
the greedy tokens and the prompt's logits with transformers' Qwen3 on the same checkpoint.
"""
from __future__ import annotations

import contextlib
import random
import tempfile
from unittest import mock

import torch

from minipaged.exercises import checking
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
from minipaged.models.input_metadata import InputMetadata
from minipaged.models.llama import LlamaAttention

NAME = "qwen3_queries_keys"
NEW_TOKENS = 12
PROMPT_LENGTHS = (9, 14)
ATOL = 1e-4  # the logits' tolerance (float32 on the CPU)


def package_queries_keys(attn, positions, q, k):
    """The package's step (``LlamaAttention.forward`` with Qwen3's per-head norms)."""
    T = q.shape[0]
    q = q.view(T, attn.num_heads, attn.head_size)  # (T, H, D)
    k = k.view(T, attn.num_kv_heads, attn.head_size)  # (T, KVH, D)
    return attn.rotary(positions, attn.q_norm(q), attn.k_norm(k))


# -- realistic mistakes, to name the cause -----------------------------------------------------
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _candidates(attn, positions, q, k) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What each mistake gives, as flat (T, H * D) queries and keys."""
    T, H, KVH, D = q.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_size
    eps = attn.q_norm.eps
    qh, kh = q.view(T, H, D), k.view(T, KVH, D)

    def rotated(a, b):
        ra, rb = attn.rotary(positions, a, b)
        return ra.reshape(T, -1), rb.reshape(T, -1)

    whole_q = _rms(q, attn.q_norm.weight.repeat(H), eps).view(T, H, D)  # over H * D numbers
    whole_k = _rms(k, attn.k_norm.weight.repeat(KVH), eps).view(T, KVH, D)
    rq, rk = attn.rotary(positions, qh, kh)
    return {
        "right": rotated(attn.q_norm(qh), attn.k_norm(kh)),
        "whole": rotated(whole_q, whole_k),
        "after": (attn.q_norm(rq).reshape(T, -1), attn.k_norm(rk).reshape(T, -1)),
        "unnormed": rotated(qh, kh),
        "unrotated": (attn.q_norm(qh).reshape(T, -1), attn.k_norm(kh).reshape(T, -1)),
        "swapped": rotated(attn.k_norm(qh), attn.q_norm(kh)),
    }


_HINTS = {
    "whole": ("your {what} were normed over all their heads' numbers at once (num_heads x "
              "head_size): Qwen3's norm is per head, each head's head_size numbers on their own "
              "(the norm's weight has head_size numbers)"),
    "after": ("your {what} were normed after the rotation: Qwen3 norms them first, then rotates "
              "(the norm's weight scales each of the D numbers differently, so the order shows)"),
    "unnormed": "your {what} were rotated but not normed: Qwen3 norms each head's {one} too",
    "unrotated": "your {what} were normed but not rotated: the rotation still follows the norm",
    "swapped": ("your {what} were normed with the other norm's weight: the queries have q_norm, "
                "the keys k_norm"),
}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def _cause(got: tuple, candidates: dict) -> str:
    for i, (what, one) in enumerate((("queries", "query"), ("keys", "key"))):
        if _close(got[i], candidates["right"][i]):
            continue
        for mistake, hint in _HINTS.items():
            if _close(got[i], candidates[mistake][i]):
                return hint.format(what=what, one=one)
        return (f"your {what} differ from the norm-then-rotate of each head: compare one "
                f"head's numbers with attn.{what[0]}_norm of them, then with the rotation")
    return ""


def _flat(out, T: int, name: str):
    """The learner's (q, k) as flat (T, n) tensors, or a hint saying what is wrong with it."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and all(isinstance(t, torch.Tensor) for t in out)):
        return None, f"return a pair (q, k) of tensors, got {type(out).__name__}"
    try:
        return tuple(t.reshape(T, -1) for t in out), ""
    except RuntimeError:
        return None, f"return {name} with T rows (e.g. (T, heads, head_size))"


# -- the tiny checkpoint --------------------------------------------------------------------------
def _tiny_qwen3(path: str):
    from minipaged.lab.tiny_families import save_tiny

    return save_tiny("qwen3", path, seed=3)


@contextlib.contextmanager
def plugged_in(fn):
    """Every ``LlamaAttention`` runs ``fn`` between its projections and its attention."""

    def forward(self, positions, hidden, kv_cache, meta):
        T = hidden.shape[0]
        q, k, v = self.qkv(hidden)  # (T, H * D), (T, KVH * D), (T, KVH * D)
        q, k = fn(self, positions, q, k)
        out = self.attn(q.reshape(T, -1), k.reshape(T, -1), v, kv_cache, meta)  # (T, H * D)
        return self.o_proj(out)

    with mock.patch.object(LlamaAttention, "forward", forward):
        yield


@torch.no_grad()
def prompt_logits(llm, prompt: list[int]) -> torch.Tensor:
    """Our model's logits at every position of ``prompt``, one prefill on the engine's cache.

    Args:
        llm: an ``LLM`` on the checkpoint, with at least ceil(len(prompt) / block_size) blocks.
        prompt: token ids.
    """
    engine = llm.llm_engine
    worker = engine.worker
    slots = torch.arange(len(prompt), dtype=torch.long)  # blocks 0, 1, ... in order
    meta = InputMetadata([len(prompt)], slots, torch.zeros(0, 0, dtype=torch.int32),
                         torch.zeros(0, dtype=torch.int32), 0)
    hidden = worker.model(torch.tensor(prompt), torch.arange(len(prompt)),
                          worker.cache_engine.gpu_cache, meta)  # (T, hidden)
    return worker.model.compute_logits(hidden)  # (T, vocab)


@exercise
def check_qwen3_queries_keys(fn, num_cases: int = 24, seed: int | None = 0) -> CheckResult:
    from minipaged.entrypoints.llm import LLM
    from minipaged.sampling_params import SamplingParams
    from minipaged.lab.tiny_families import VOCAB, greedy_tokens

    learner = Learner(NAME, fn)
    rng = rng_for(seed)
    with tempfile.TemporaryDirectory() as path:
        hf = _tiny_qwen3(path)
        llm = LLM(path, block_size=4, num_gpu_blocks=32, max_model_len=128, dtype="float32",
                  enable_prefix_caching=False, seed=0)
        layers = llm.llm_engine.worker.model.layers
    # 1. on random tensors, next to the package's step (each layer has its own norms)
    for case in range(num_cases):
        attn = layers[case % len(layers)].self_attn
        T = rng.choice([1, 2, 5, 8])
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        q = torch.randn(T, attn.num_heads * attn.head_size, generator=g) * rng.uniform(0.2, 5)
        k = torch.randn(T, attn.num_kv_heads * attn.head_size, generator=g) * rng.uniform(0.2, 5)
        positions = torch.tensor(sorted(rng.sample(range(100), T)))
        with torch.no_grad():
            candidates = _candidates(attn, positions, q, k)
            try:
                out = learner(attn, positions, q.clone(), k.clone())
            except checking.NotDone:
                raise
            except Exception as error:  # a shape that does not fit: say which
                hint = (f"it raised {type(error).__name__}: {error}. The norms' weights have "
                        f"head_size = {attn.head_size} numbers: they apply to each head's "
                        f"numbers, so look at q as (T, num_heads, head_size) first")
                fail(NAME, case, f"layer {case % len(layers)}, T={T}, positions="
                     f"{positions.tolist()}", "an error", "(q, k)", hint)
        inputs = f"layer {case % len(layers)}, T={T}, positions={positions.tolist()}"
        got, problem = _flat(out, T, "q and k")
        if problem:
            fail(NAME, case, inputs, out if not isinstance(out, tuple) else "(shapes)",
                 "(q, k)", problem)
        if not all(_close(g_, w) for g_, w in zip(got, candidates["right"])):
            which = 0 if not _close(got[0], candidates["right"][0]) else 1
            fail(NAME, case, inputs,
                 [round(x, 4) for x in got[which][0, :4].tolist()],
                 [round(x, 4) for x in candidates["right"][which][0, :4].tolist()],
                 f"({'queries' if which == 0 else 'keys'}, first token, first 4 numbers) "
                 + _cause(got, candidates))
    # 2. plugged into our Qwen3, against transformers' on the same checkpoint
    prompt_rng = random.Random(7)
    prompts = [[prompt_rng.randrange(2, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with plugged_in(learner), torch.no_grad():
        ours = [o.outputs[0].token_ids for o in llm.generate(
            prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
        for i, prompt in enumerate(prompts):
            want = greedy_tokens(hf, prompt, NEW_TOKENS)
            if ours[i] != want:
                fail(NAME, num_cases + i, f"the tiny Qwen3, greedy, prompt {prompt}", ours[i],
                     want, "the random cases passed but the model's tokens differ: does your "
                     "function change q or k in place, or keep state between calls?")
            logits = prompt_logits(llm, prompt)  # (T, vocab)
            ref = hf(torch.tensor([prompt])).logits[0]  # (T, vocab)
            gap = float((logits - ref).abs().max())
            if gap > ATOL:
                fail(NAME, num_cases + i, f"the tiny Qwen3, the prompt's logits, prompt {prompt}",
                     f"largest difference {gap:.2e}", f"<= {ATOL:g}",
                     "the logits drift from transformers': check each step against the package")
    result = passed(learner, num_cases)
    extra = (f"; in our Qwen3 its greedy tokens equal transformers' on {len(prompts)} prompts "
             f"({NEW_TOKENS} tokens each) and its logits are within {ATOL:g}")
    # (the message is printed by @exercise after this returns)
    return CheckResult(str(result) + extra, result.status)


def usable_qwen3_queries_keys(fn):
    """``fn`` once its check passed; until then the package's step."""
    return checking.usable(NAME, fn, package_queries_keys)


__all__ = ["check_qwen3_queries_keys", "usable_qwen3_queries_keys", "package_queries_keys",
           "plugged_in", "prompt_logits"]
