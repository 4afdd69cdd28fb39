"""csrc/layer_kernels.cu on a GPU: RMSNorm (with the residual add), the rotary embedding and
SiLU-and-multiply against the torch reference on the same GPU, and the model's dispatch to them.

Written to run on a GPU machine (scripts/gpu_check.sh, stage 2); the same kernels built for the
CPU are checked in tests/kernels/test_layer_kernels.py.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from minipaged.kernels import ops, reference  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def close(ours, ref, dtype, units):
    assert not torch.isnan(ours).any()
    ours, ref = ours.double().cpu(), ref.double().cpu()
    bound = units * ULP[dtype] * ref.abs().clamp(min=1e-3) + 1e-7
    assert ((ours - ref).abs() <= bound).all(), (ours - ref).abs().max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_layer_ops_run_our_kernels_and_match_the_reference(dtype):
    gen = torch.Generator(device="cuda").manual_seed(3)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(dtype)
    x, residual, weight = rand(64, 4096), rand(64, 4096), 1 + 0.1 * rand(4096)
    before = ops.calls.copy()
    units = 8 if dtype == torch.float32 else 2.01
    close(ops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), dtype, units)
    out, total = ops.add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_total = reference.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, ref_total)
    close(out, ref_out, dtype, units)

    q, k = rand(64, 32, 128), rand(64, 8, 128)
    emb = torch.randn(2048, 128, generator=gen, device="cuda")
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.randint(0, 2048, (64,), generator=gen, device="cuda")
    for ours, ref in zip(ops.rotary(positions, q, k, cos, sin),
                         reference.rotary(positions, q, k, cos, sin)):
        close(ours, ref, dtype, 1.01 if dtype != torch.float32 else 8)

    gate, up = 3 * rand(64, 11008), rand(64, 11008)
    close(ops.silu_and_mul(gate, up), reference.silu_and_mul(gate, up), dtype, 2.01)
    gate, up = (3 * rand(64, 2 * 11008)).split(11008, dim=-1)  # one [gate | up] matmul's halves
    close(ops.silu_and_mul(gate, up), reference.silu_and_mul(gate, up), dtype, 2.01)
    for name in ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul"):
        assert ops.calls[name, "cuda"] == before[name, "cuda"] + (2 if name == "silu_and_mul"
                                                                  else 1), name


def test_the_kernels_capture_in_a_cuda_graph():
    x = torch.randn(8, 256, device="cuda", dtype=torch.float16)
    weight = torch.randn(256, device="cuda", dtype=torch.float16)
    expected = reference.rms_norm(x, weight, 1e-6)
    graph = torch.cuda.CUDAGraph()
    ops.rms_norm(x, weight, 1e-6)  # warm-up outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = ops.rms_norm(x, weight, 1e-6)
    graph.replay()
    torch.cuda.synchronize()
    close(out, expected, torch.float16, 2.01)
