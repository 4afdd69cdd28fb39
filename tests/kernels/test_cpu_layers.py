"""The C++ CPU op's element-wise layers (csrc/cpu/layers.cpp) equal the torch reference.

Inputs are N(0, 1) (or wider, where a range matters) and errors relative; shapes include widths
that are not a multiple of the 8 vector lanes and rows at a stride (the halves of a fused
gate/up matmul, q and k cut out of a fused q/k/v one), as the model passes them.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from minipaged import LLM, SamplingParams
from minipaged.kernels import ops, reference


def rel_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), width=st.integers(1, 300), seed=st.integers(0, 2**16),
       spread=st.sampled_from([1.0, 8.0, 60.0]))
def test_silu_and_mul_on_the_halves_of_a_fused_matmul(cpu_op, rows, width, seed, spread):
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(rows, 2 * width, generator=gen) * spread
    gate, up = fused.split(width, dim=-1)  # rows 2 * width apart, as the MLP passes them
    got, want = cpu_op.silu_and_mul(gate, up), reference.silu_and_mul(gate, up)
    assert got.shape == want.shape
    # (relative to the largest output: a row of very negative gates is all zeros)
    assert (got - want).abs().max() <= 1e-5 * max(want.abs().max().item(), 1e-3)
    if spread == 1.0:
        assert rel_error(got, want) < 1e-5


def test_silu_s_exponential_over_the_float_range(cpu_op):
    """Every gate from -100 to 100 (the exponential clamps where e^x leaves the float range),
    infinities, and NaN staying NaN."""
    gate = torch.cat([torch.linspace(-100, 100, 20001), torch.tensor([float("inf"), -1e30])])
    up = torch.ones_like(gate)
    got = cpu_op.silu_and_mul(gate[None], up[None])[0]
    want = reference.silu_and_mul(gate, up)
    close = torch.isclose(got, want, rtol=2e-6, atol=1e-30)
    assert close.all(), (gate[~close], got[~close], want[~close])
    nan = torch.tensor([[1.0, float("nan"), -3.0, 0.5, 2.0, 1.0, 1.0, 1.0, float("nan")]])
    out = cpu_op.silu_and_mul(nan, torch.ones_like(nan))
    assert out.isnan().tolist() == nan.isnan().tolist()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), width=st.integers(1, 300), seed=st.integers(0, 2**16),
       eps=st.sampled_from([1e-6, 1e-5, 0.1]))
def test_rms_norm_and_the_residual_add(cpu_op, rows, width, seed, eps):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width + 3, generator=gen)[:, 3:]  # rows at a stride
    residual = torch.randn(rows, width, generator=gen) * 4
    weight = torch.randn(width, generator=gen)
    assert rel_error(cpu_op.rms_norm(x, weight, eps), reference.rms_norm(x, weight, eps)) < 1e-5
    (out, total), (want_out, want_total) = (cpu_op.add_rms_norm(x, residual, weight, eps),
                                            reference.add_rms_norm(x, residual, weight, eps))
    assert torch.equal(total, want_total)  # one float addition each
    assert rel_error(out, want_out) < 1e-5
    heads = torch.randn(rows, 3, width, generator=gen)  # Qwen3's per-head norm: 3-D
    assert rel_error(cpu_op.rms_norm(heads, weight, eps),
                     reference.rms_norm(heads, weight, eps)) < 1e-5


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 40), heads=st.integers(1, 9), kv_heads=st.integers(1, 3),
       half=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_rotary_on_q_and_k_cut_from_one_matmul(cpu_op, tokens, heads, kv_heads, half, seed):
    gen = torch.Generator().manual_seed(seed)
    D = 2 * half
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * D, generator=gen)
    q = qkv[:, :heads * D].view(tokens, heads, D)
    k = qkv[:, heads * D:(heads + kv_heads) * D].view(tokens, kv_heads, D)
    angles = torch.rand(100, D, generator=gen) * 6.3
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    got, want = cpu_op.rotary(positions, q, k, cos, sin), reference.rotary(positions, q, k,
                                                                            cos, sin)
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel_error(g, w) < 1e-5


def test_bad_input_is_named(cpu_op):
    m = cpu_op.module
    q, k = torch.randn(2, 3, 8), torch.randn(2, 1, 8)
    cos = sin = torch.randn(10, 8)
    with pytest.raises(RuntimeError, match=r"positions\[1\] = 10 is outside the rotary "
                                           r"tables' \[0, 10\)"):
        m.rotary(torch.tensor([0, 10]), q, k, cos, sin)
    with pytest.raises(RuntimeError, match="positions must be a contiguous int64 vector of 2"):
        m.rotary(torch.tensor([0]), q, k, cos, sin)
    with pytest.raises(RuntimeError, match="head_size must be even"):
        m.rotary(torch.tensor([0, 1]), q[..., :7], k[..., :7], cos[:, :7], sin[:, :7])
    with pytest.raises(RuntimeError, match="gate: float32 only, got BFloat16"):
        m.silu_and_mul(torch.randn(2, 4).bfloat16(), torch.randn(2, 4))
    with pytest.raises(RuntimeError, match=r"gate is \[2, 4\] but up is \[2, 5\]"):
        m.silu_and_mul(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32 vector of 4"):
        m.rms_norm(torch.randn(2, 4), torch.randn(5), 1e-6)
    with pytest.raises(RuntimeError, match=r"x must be \(tokens, features\)"):
        m.rms_norm(torch.randn(4), torch.randn(4), 1e-6)
    # the wrappers send what the C++ code does not take (other dtypes) to the reference
    x = torch.randn(3, 8).bfloat16()
    assert torch.equal(cpu_op.silu_and_mul(x, x), reference.silu_and_mul(x, x))


def test_the_profiler_names_the_c_plus_plus_calls(cpu_op):
    """A pybind11 function is no torch operator: its time is a named row of the profiler's table
    all the same (scripts/profile_decode.py prints that table); without a profiler, the same."""
    x, weight = torch.randn(4, 64), torch.randn(32, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = cpu_op.linear(x, weight)
        cpu_op.rms_norm(x, torch.ones(64), 1e-6)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("minipaged_cpu::linear") == 1 and counts.get("minipaged_cpu::rms_norm") == 1
    assert rel_error(y, x @ weight.t()) < 1e-5
    assert torch.equal(cpu_op.linear(x, weight), y)  # (the same function without a profiler)
    # the module's own attributes as they are (scripts/check_compiled_ops.py prints __file__)
    assert cpu_op.module.__file__.endswith(".so") and cpu_op.module.__name__.startswith("minipaged")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # qwen3: a norm over each head too
def test_a_float32_engine_runs_them_and_gives_transformers_tokens(cpu_op, tmp_path, kind):
    from tiny_models import greedy_reference, pick_prompts, save_tiny_model

    hf = save_tiny_model(kind, tmp_path, seed=5)
    prompts = pick_prompts(hf, [11, 4, 17], 10, seed=2)
    want = [greedy_reference(hf, p, 10) for p in prompts]
    before = ops.calls.copy()
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    for name in ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul"):
        assert ops.calls[name, "cpu"] > before[name, "cpu"], name
