"""Lesson 07 exercises: what one attention layer does with the tokens of a flat batch.

    chunk_mask(context_len, num_new) -> (num_new, context_len) booleans
        which cached positions each new token of a prefill chunk may attend to: the chunk is the
        last ``num_new`` of ``context_len`` tokens (the earlier ones are already in the cache);
        row i is the chunk's i-th token, column j the token at position j; True where allowed
    rotate(vec, position, inv_freq) -> (D,) tensor
        the rotary embedding of one head's query or key vector ``vec`` (D,) at ``position``: for
        each i < D/2, dimensions i and i + D/2 form a pair that turns by the angle
        ``position * inv_freq[i]`` (counter-clockwise, the first of the pair as the x axis)

Expected answers: ``reference.paged_prefill_attention`` on a paged cache (the mask is read out
of what it attends to) and ``models.rotary.RotaryEmbedding`` (as LLaMA layers call it).

The build track's component (``workbench``): ``Attention``, the forward of the paged attention
layer (``MyAttention``, a ``PagedAttention`` whose ``forward`` the learner writes), checked on
random mixed steps against the package's layer and plugged in where GPT-2 and LLaMA build it.
"""
from __future__ import annotations

import dataclasses
import os
import traceback
import types

import torch

from minipaged.exercises import workbench
from minipaged.exercises.checking import (CheckResult, Learner, exercise, fail, not_done, passed,
                                          rng_for)
from minipaged.exercises.random_steps import describe, random_step
from minipaged.kernels import kv_quant, ops, reference
from minipaged.models.attention import PagedAttention
from minipaged.models.input_metadata import InputMetadata
from minipaged.models.rotary import RotaryEmbedding, rope_inv_freq
from minipaged.worker.model_runner import prepare_inputs as package_prepare_inputs


def package_chunk_mask(context_len: int, num_new: int, block_size: int = 4,
                       seed: int = 0) -> torch.Tensor:
    """The package's mask, read out of ``paged_prefill_attention``: with all logits equal, a new
    token spreads its attention evenly over the positions it may see; values that are one-hot
    per position then show which those are. (num_new, context_len) bool."""
    g = torch.Generator().manual_seed(seed)
    head_size = 4 * -(-context_len // 4)  # one-hot values need a dimension per position
    num_blocks = -(-context_len // block_size)
    pool = num_blocks + 3
    table = torch.randperm(pool, generator=g)[:num_blocks]  # scattered physical blocks
    key_cache = torch.zeros(pool, 1, head_size // 4, block_size, 4)
    value_cache = torch.zeros(pool, 1, head_size, block_size)
    pos = torch.arange(context_len)
    slots = table[pos // block_size] * block_size + pos % block_size  # (L,)
    keys = torch.randn(context_len, 1, head_size, generator=g)
    values = torch.eye(context_len, head_size)[:, None, :]  # (L, 1, D): one-hot per position
    reference.reshape_and_cache(keys, values, key_cache, value_cache, slots)
    query = torch.zeros(num_new, 1, head_size)  # every logit 0: uniform over what is allowed
    out = reference.paged_prefill_attention(
        query, key_cache, value_cache, table[None].to(torch.int32),
        torch.tensor([0, num_new], dtype=torch.int32),
        torch.tensor([context_len], dtype=torch.int32), 1.0)  # (num_new, 1, D)
    return out[:, 0, :context_len] > 0


def _as_bools(got, num_new, context_len):
    t = torch.as_tensor(got)
    if tuple(t.shape) != (num_new, context_len):
        return None
    return t.bool()


@exercise
def check_chunk_mask(fn, num_cases: int = 60, seed: int | None = 0) -> CheckResult:
    learner = Learner("chunk_mask", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        context_len = rng.randint(1, 24)
        num_new = rng.randint(1, context_len)
        expected = package_chunk_mask(context_len, num_new, rng.choice([1, 2, 4, 8]),
                                      rng.randrange(1000))
        got = _as_bools(learner(context_len, num_new), num_new, context_len)
        if got is None or not torch.equal(got, expected):
            if got is None:
                hint = "one row per new token, one column per position of the whole context"
            elif torch.equal(got, torch.ones_like(expected).tril()[:num_new]):
                hint = ("row i is not position i: the chunk's tokens come after the "
                        "context_len - num_new cached ones")
            elif not got[:, :context_len - num_new].all():
                hint = "every new token may read the whole cached prefix"
            else:
                hint = "inside the chunk the mask is causal: a token sees itself, not later ones"
            expected_rows = ["".join("x" if a else "." for a in row) for row in expected.tolist()]
            got_rows = (None if got is None else
                        ["".join("x" if a else "." for a in row) for row in got.tolist()])
            fail(learner.name, case, f"context_len={context_len}, num_new={num_new} "
                 f"(x = may attend)", got_rows, expected_rows, hint)
    return passed(learner, num_cases)


def package_rotate(vec: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """``RotaryEmbedding`` of a LLaMA layer on one vector: (D,) -> (D,)."""
    rotary = RotaryEmbedding(types.SimpleNamespace(rope_theta=theta), vec.shape[0], position + 1)
    q = vec[None, None, :]  # (T=1, H=1, D)
    rotated, _ = rotary(torch.tensor([position]), q, q)
    return rotated[0, 0]


def _flip(vec: torch.Tensor) -> torch.Tensor:
    """The second half negated: turning a flipped vector one way turns the vector the other."""
    half = vec.shape[0] // 2
    return torch.cat((vec[:half], -vec[half:]))


@exercise
def check_rotate(fn, num_cases: int = 60, seed: int | None = 0) -> CheckResult:
    learner = Learner("rotate", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        head_size = rng.choice([4, 8, 16, 64])
        theta = rng.choice([10000.0, 100000.0, 500.0])
        position = rng.choice([0, 1, 2, rng.randint(3, 300)])
        g = torch.Generator().manual_seed(rng.randrange(10**6))
        vec = torch.randn(head_size, generator=g)
        inv_freq, _ = rope_inv_freq(types.SimpleNamespace(rope_theta=theta), head_size)
        expected = package_rotate(vec, position, theta)
        got = learner(vec.clone(), position, inv_freq.clone())
        got = torch.as_tensor(got, dtype=torch.float32).flatten()
        if got.shape != expected.shape or not torch.allclose(got, expected, atol=1e-3, rtol=1e-3):
            half = head_size // 2
            if got.shape != expected.shape:
                hint = "return one vector of the same size as vec"
            elif position and torch.allclose(got, _flip(package_rotate(_flip(vec), position,
                                                                       theta)), atol=1e-3,
                                             rtol=1e-3):
                hint = ("turned the wrong way round: counter-clockwise, with the first of the "
                        "pair as the x axis")
            elif torch.allclose(got.norm(), vec.norm(), rtol=1e-3):
                hint = (f"a rotation keeps the length, good; now which dimensions pair up? "
                        f"(i with i + {half}, not with i + 1)")
            else:
                hint = ("a rotation keeps the vector's length: write each pair as a point (x, y) "
                        "and turn it about the origin")
            fail(learner.name, case, f"head_size={head_size}, position={position}, "
                 f"vec[:4]={[round(v, 3) for v in vec[:4].tolist()]}",
                 [round(v, 3) for v in got[:6].tolist()] if got.numel() else got.tolist(),
                 [round(v, 3) for v in expected[:6].tolist()], hint + " (first 6 values shown)")
    return passed(learner, num_cases)


# -- the build track: the attention layer's forward ----------------------------------------------
class MyAttention(PagedAttention):
    """The paged attention layer; ``__init__`` is the package's (num_heads, head_size, scale,
    num_kv_heads, sliding_window), only ``forward`` is yours."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...] | None, meta: InputMetadata) -> torch.Tensor:
        """Attention of the step's ``T`` tokens, (T, num_heads * head_size).

        Args:
            query: (T, num_heads * head_size); key, value: (T, num_kv_heads * head_size).
            kv_cache: this layer's ``(key_cache, value_cache)`` (or None: prompts only); an
                8-bit cache (lesson 18) adds ``(key_scales, value_scales)``, which the ops take
                as ``kv_scales``.
            meta: the batch's layout: fresh prompts, then chunks, then decode tokens.

        First write every token's key and value into its slot (``ops.reshape_and_cache`` with
        ``meta.slot_mapping``), then run each part through its path: ``ops.prefill_attention``,
        ``ops.paged_prefill_attention``, ``ops.paged_attention``.

        A layer with ``self.sliding_window = w`` (Mistral, Gemma 3's local layers: lesson 20)
        lets each token see only the ``w`` newest tokens, itself included, on every path (each
        op takes ``window=``); ``None`` is the whole context.
        """
        not_done()  # <- your code here


_CACHE_HINT = ("write the key and value of EVERY token of the step (fresh prompts, chunks and "
               "decodes alike) into its slot (ops.reshape_and_cache with meta.slot_mapping) "
               "before any path reads the cache: a chunk and a decode token read their own new "
               "key from it too, and later steps read the prompts' keys")
_PART_HINTS = {
    "fresh prompt": "the fresh prompts (the first meta.num_fresh_prompt_tokens rows) attend only "
                    "to themselves, causally, prompt by prompt (meta.prompt_lens)",
    "chunk": "a chunk's rows come after the fresh prompts' (meta.num_chunk_tokens of them) and "
             "read their context from the cache through meta.chunk_block_tables",
    "decode": "the last rows, one per decoding sequence, read their whole context from the cache "
              "(meta.block_tables, meta.context_lens, meta.max_context_len), its own "
              "new key included: written before it is read",
}
_WINDOW_HINT = ("this layer has a sliding window (self.sliding_window = {window}): each token "
                "sees only the {window} newest tokens, itself included, on every path: pass "
                "window=self.sliding_window to each op; this row is what the whole context gives")


def _check_attention(candidate, rng, num_cases: int) -> int:
    """Random mixed steps, GPT-2 shapes (one kv head per head) and LLaMA shapes (grouped
    queries): the candidate's output and the cache it writes against ``PagedAttention``'s."""
    for case in range(num_cases):
        step = random_step(rng, rng.choice([1, 2, 4, 8, 16]))
        head_size = rng.choice([8, 16, 32, 64])
        num_kv_heads = rng.choice([1, 2, 3])
        gpt2_shape = rng.random() < 0.5
        num_heads = num_kv_heads * (1 if gpt2_shape else rng.choice([1, 2, 3]))
        scale = head_size ** -0.5
        window = rng.randint(1, 8) if case % 3 == 2 else None  # a sliding-window layer
        make = ((lambda cls: cls(num_heads, head_size, scale)) if gpt2_shape and window is None
                else (lambda cls: cls(num_heads, head_size, scale, num_kv_heads,
                                      sliding_window=window)))
        meta = package_prepare_inputs(step.runs, step.block_size, torch.device("cpu")).meta
        num_tokens = int(meta.slot_mapping.shape[0])
        g = torch.Generator().manual_seed(rng.randrange(10**9))
        query = torch.randn(num_tokens, num_heads * head_size, generator=g)
        key = torch.randn(num_tokens, num_kv_heads * head_size, generator=g)
        value = torch.randn(num_tokens, num_kv_heads * head_size, generator=g)
        x = ops.key_vector_size(torch.float32)
        # every slot holds some earlier key/value: what a chunk or a decode finds of its past
        key_cache = torch.randn(step.num_blocks, num_kv_heads, head_size // x, step.block_size,
                                x, generator=g)
        value_cache = torch.randn(step.num_blocks, num_kv_heads, head_size, step.block_size,
                                  generator=g)
        caches = [(key_cache.clone(), value_cache.clone()) for _ in range(2)]
        inputs = (f"{'GPT-2' if gpt2_shape else 'LLaMA'} shape: {num_heads} heads, "
                  f"{num_kv_heads} kv heads, head_size {head_size}"
                  f"{'' if window is None else f', sliding_window {window}'}; {describe(step)}")
        with torch.inference_mode():
            expected = make(PagedAttention)(query, key, value, caches[0], meta)
            try:
                got = make(candidate)(query.clone(), key.clone(), value.clone(), caches[1],
                                      meta)
            except Exception as error:
                op = _raising_op(error)
                if op is None:
                    raise  # raised in the learner's own lines: the traceback shows where
                fail("Attention", case, inputs, _Said(f"ops.{op} raised {type(error).__name__}: "
                                                      f"{error}"), _Said("an output"),
                     _OP_HINTS[op])
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
            fail("Attention", case, inputs, getattr(got, "shape", got), expected.shape,
                 "return one row per token: (T, num_heads * head_size)")
        for name, mine, package in (("key", caches[1][0], caches[0][0]),
                                    ("value", caches[1][1], caches[0][1])):
            if not torch.equal(mine, package):
                slot = _first_slot_that_differs(mine, package, meta.slot_mapping, name == "key")
                token = meta.slot_mapping.tolist().index(slot) if slot is not None else None
                fail("Attention", case, inputs + f"; the {name} cache at slot {slot}",
                     _Said(f"not token {token}'s {name}"), _Said(f"token {token}'s {name}")
                     if slot is not None else _Said("what was there before the step"),
                     _CACHE_HINT)
        error = (got - expected).abs().amax(dim=-1) / expected.abs().amax().clamp(min=1.0)  # (T,)
        if not torch.isfinite(error).all() or error.max() > 1e-4:
            row = int(torch.nonzero(~(error <= 1e-4))[0])
            part = ("fresh prompt" if row < meta.num_fresh_prompt_tokens else "chunk"
                    if row < meta.num_prompt_tokens else "decode")
            hint = _PART_HINTS[part]
            if window is not None and _close(got[row], _whole_context(
                    num_heads, head_size, scale, num_kv_heads, query, key, value, key_cache,
                    value_cache, meta)[row]):
                hint = _WINDOW_HINT.format(window=window)
            elif part != "fresh prompt" and _close(got[row], _read_before_write(
                    make, query, key, value, key_cache, value_cache, meta)[row]):
                hint = _READ_BEFORE_WRITE_HINT  # the right paths, on the cache of before
            fail("Attention", case, inputs + f"; row {row} ({part} part of the batch), "
                 f"first values", [round(v, 4) for v in got[row, :4].tolist()],
                 [round(v, 4) for v in expected[row, :4].tolist()], hint)
    return num_cases


# an op that raised on the arguments it was given -> what it is for, and what it takes
_OP_HINTS = {
    "reshape_and_cache": "the cache write got arguments it cannot use: every token's key and "
                         "value, shaped (T, num_kv_heads, head_size), go to its slot in "
                         "meta.slot_mapping",
    "prefill_attention": "the fresh prompts' path got arguments it cannot use: "
                         + _PART_HINTS["fresh prompt"],
    "paged_prefill_attention": "the chunks' path got arguments it cannot use: "
                               + _PART_HINTS["chunk"],
    "paged_attention": "the decode path got arguments it cannot use: " + _PART_HINTS["decode"],
}


def _raising_op(error: BaseException) -> str | None:
    """The kernel function (``ops``' or the reference's, called by the learner's forward) in
    which ``error`` was raised, or None when it was raised in the learner's own code."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in frames:
        if f"{os.sep}kernels{os.sep}" in frame.filename and frame.name in _OP_HINTS:
            return frame.name
    return None


_READ_BEFORE_WRITE_HINT = (
    "this row is what the paths give on the cache as it was BEFORE the step: the cache ends up "
    "right, but it was written too late; a chunk or a decode token reads its context from the "
    "cache, its own new key included: written before it is read (ops.reshape_and_cache with "
    "meta.slot_mapping, first)")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).abs().amax() / b.abs().amax().clamp(min=1.0)) <= 1e-4)


def _whole_context(num_heads, head_size, scale, num_kv_heads, query, key, value, key_cache,
                   value_cache, meta) -> torch.Tensor:
    """The package's output without the sliding window, on the cache of before the step.
    (T, num_heads * head_size)"""
    with torch.inference_mode():
        return PagedAttention(num_heads, head_size, scale, num_kv_heads)(
            query, key, value, (key_cache.clone(), value_cache.clone()), meta)


def _read_before_write(make, query, key, value, key_cache, value_cache, meta) -> torch.Tensor:
    """The package's output when every path reads the cache of before the step: the step's
    keys and values go to a scratch block that no block table lists. (T, num_heads * head_size)"""
    block_size = value_cache.shape[-1]
    scratch = (torch.cat([key_cache, key_cache[:1]]), torch.cat([value_cache, value_cache[:1]]))
    nowhere = torch.full_like(meta.slot_mapping, key_cache.shape[0] * block_size)  # (T,)
    with torch.inference_mode():
        return make(PagedAttention)(query, key, value, scratch,
                                    dataclasses.replace(meta, slot_mapping=nowhere))


class _Said(str):
    """Words in the checker's message, printed without quotes."""

    def __repr__(self) -> str:
        return str(self)


def _first_slot_that_differs(mine, package, slot_mapping, is_key):
    """The first slot of the step whose cached vector differs (None: a slot outside the step)."""
    for slot in slot_mapping.tolist():
        block, offset = divmod(slot, package.shape[-2] if is_key else package.shape[-1])
        where = (block, slice(None), slice(None), offset)
        if not torch.equal(mine[where], package[where]):
            return slot
    return None


workbench.register(workbench.Component(
    name="Attention", lesson="07",
    slots=("minipaged.models.gpt2:PagedAttention", "minipaged.models.llama:PagedAttention"),
    check=_check_attention, solution="minipaged.exercises.answers.lesson07:Attention",
    preamble="from minipaged.exercises.lesson07 import *", num_cases=60))
