"""Lesson 20's exercise, Qwen3's per-head q/k norm: answers written as a learner writes them
pass (checked on random tensors, then in our Qwen3 against transformers' on a tiny random
checkpoint); the realistic mistakes fail with a hint naming what went wrong."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minipaged.exercises import lesson20 as ex, not_done, solutions as S

pytestmark = pytest.mark.lesson20


def rms(x, weight, eps=1e-6):
    """A learner's own RMSNorm over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def learner_own_norm(attn, positions, q, k):
    """Written with the learner's own norm and einops-free reshapes, returning flat tensors."""
    n, d = q.shape[0], attn.head_size
    heads_q = q.reshape(n, -1, d)
    heads_k = k.reshape(n, -1, d)
    heads_q = rms(heads_q, attn.q_norm.weight, attn.q_norm.eps)
    heads_k = rms(heads_k, attn.k_norm.weight, attn.k_norm.eps)
    rq, rk = attn.rotary(positions, heads_q, heads_k)
    return rq.flatten(1), rk.flatten(1)


def learner_functional(attn, positions, q, k):
    """torch's own rms_norm, a helper per tensor, unflatten."""
    def norm_heads(x, norm):
        x = x.unflatten(-1, (-1, attn.head_size))  # (T, heads, D)
        return F.rms_norm(x, (attn.head_size,), norm.weight, norm.eps)

    return attn.rotary(positions, norm_heads(q, attn.q_norm), norm_heads(k, attn.k_norm))


def whole_hidden(attn, positions, q, k):
    """The mistake: one norm over all heads' numbers (weight tiled to fit)."""
    T = q.shape[0]
    q = rms(q, attn.q_norm.weight.repeat(attn.num_heads), attn.q_norm.eps)
    k = rms(k, attn.k_norm.weight.repeat(attn.num_kv_heads), attn.k_norm.eps)
    return attn.rotary(positions, q.view(T, attn.num_heads, -1), k.view(T, attn.num_kv_heads, -1))


def after_rotation(attn, positions, q, k):
    T = q.shape[0]
    q, k = attn.rotary(positions, q.view(T, attn.num_heads, attn.head_size),
                       k.view(T, attn.num_kv_heads, attn.head_size))
    return attn.q_norm(q), attn.k_norm(k)


def key_forgotten(attn, positions, q, k):
    T = q.shape[0]
    q = attn.q_norm(q.view(T, attn.num_heads, attn.head_size))
    return attn.rotary(positions, q, k.view(T, attn.num_kv_heads, attn.head_size))


def flat_into_the_norm(attn, positions, q, k):
    """The norm module on the flat (T, H * D) tensor: its weight of D does not fit."""
    return attn.rotary(positions, attn.q_norm(q), attn.k_norm(k))


def swapped_weights(attn, positions, q, k):
    T = q.shape[0]
    q = attn.k_norm(q.view(T, attn.num_heads, attn.head_size))
    k = attn.q_norm(k.view(T, attn.num_kv_heads, attn.head_size))
    return attn.rotary(positions, q, k)


@pytest.mark.parametrize("fn", [S.qwen3_queries_keys, learner_own_norm, learner_functional],
                         ids=["reference", "own_norm", "functional"])
def test_right_answers_pass(fn):
    result = ex.check_qwen3_queries_keys(fn, num_cases=12)
    assert result.passed, result
    assert "greedy tokens equal transformers'" in result


@pytest.mark.parametrize("fn,words", [
    (whole_hidden, "normed over all their heads' numbers at once"),
    (after_rotation, "normed after the rotation"),
    (key_forgotten, "keys were rotated but not normed"),
    (flat_into_the_norm, "head_size = 16 numbers"),
    (swapped_weights, "the other norm's weight"),
])
def test_mistakes_fail_with_a_hint_naming_the_cause(fn, words):
    result = ex.check_qwen3_queries_keys(fn, num_cases=6)
    assert result.status == "failed"
    assert words in result, result


def test_a_mistake_only_the_model_shows_is_caught(monkeypatch):
    """Right on every random case, wrong in the model: the queries scaled on the engine's calls
    (a stand-in for a function that keeps state between calls)."""
    calls = {"n": 0}

    def drifting(attn, positions, q, k):
        calls["n"] += 1
        q2, k2 = S.qwen3_queries_keys(attn, positions, q, k)
        return (q2 * 1.5 if calls["n"] > 12 else q2), k2

    result = ex.check_qwen3_queries_keys(drifting, num_cases=12)
    assert result.status == "failed" and "the tiny Qwen3" in result, result


def test_unanswered_says_not_done_and_solutions_fill_in(monkeypatch):
    def unanswered(attn, positions, q, k):
        not_done()

    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    assert ex.check_qwen3_queries_keys(unanswered, num_cases=2).status == "not done"
    monkeypatch.setenv("MINIPAGED_SOLUTIONS", "1")
    assert ex.check_qwen3_queries_keys(unanswered, num_cases=2).status == "solution used"


def test_usable_gives_the_package_step_until_the_check_passed():
    def mine(attn, positions, q, k):
        return S.qwen3_queries_keys(attn, positions, q, k)

    assert ex.usable_qwen3_queries_keys(mine) is ex.package_queries_keys
    assert ex.check_qwen3_queries_keys(mine, num_cases=2).passed
    assert ex.usable_qwen3_queries_keys(mine) is mine
