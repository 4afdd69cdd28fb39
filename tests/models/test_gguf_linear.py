"""A weight held as GGUF blocks (``models/gguf_linear.py``): every routine (our C++ op, torch's
4-bit kernel, dequantized tiles) gives ``x W^T`` with W the blocks' dequantized values, up to
float rounding; the C++ op's row does not depend on the batch; bad blocks are refused by name.
On a GPU (the CUDA kernels faked here: tests/kernels/test_gguf_matmul.py runs the real one)
``cuda`` and ``dequant`` are measured per shape and per bucket of rows."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from budgets import examples
from gguf_random import random_blocks
from minipaged.kernels.gguf_blocks import FORMATS, dequantize
from minipaged.models import gguf_linear
from minipaged.models.gguf_linear import GGUFWeight, choose_routine

def random_weight(name: str, out: int, blocks: int, seed: int) -> GGUFWeight:
    return GGUFWeight(torch.from_numpy(random_blocks(name, out, blocks, seed)), FORMATS[name])


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(gguf_linear, "choices", {})
    monkeypatch.delenv("MINIPAGED_GGUF_ROUTINE", raising=False)


@settings(max_examples=examples(40), deadline=None)
@given(name=st.sampled_from(sorted(FORMATS)), out=st.sampled_from([1, 5, 16, 48, 67]),
       blocks=st.integers(1, 3), rows=st.sampled_from([1, 2, 5, 9, 300]),
       seed=st.integers(0, 2**16))
def test_every_routine_gives_the_dequantized_matmul(cpu_op, name, out, blocks, rows, seed):
    weight = random_weight(name, out, blocks, seed)
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    reference = x.double() @ weight.dequantize().double().t()
    size = (x.double().abs() @ weight.dequantize().double().abs().t()).max()  # the products'
    ran = [r for r in gguf_linear.ROUTINES if weight.runs(r, x)]
    assert "dequant" in ran and ("cpp" in ran) == (name in gguf_linear.CPP_FORMATS)
    for routine in ran:
        got = weight.linear(x, routine)
        assert got.shape == (rows, out) and got.dtype == torch.float32
        assert ((got.double() - reference).abs().max() / size).item() < 1e-5, routine


@settings(max_examples=examples(20), deadline=None)
@given(name=st.sampled_from(gguf_linear.CPP_FORMATS), rows=st.integers(2, 11),
       seed=st.integers(0, 2**16))
def test_a_row_s_result_does_not_depend_on_the_batch(cpu_op, name, rows, seed):
    weight = random_weight(name, 37, 2, seed)
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    for routine in ("cpp", "tiles") if name in gguf_linear.DEQUANTIZE_FORMATS else ("cpp",):
        whole = weight.linear(x, routine)
        for i in range(rows):
            assert torch.equal(weight.linear(x[i:i + 1], routine)[0], whole[i]), routine


def test_the_choice_is_measured_once_per_shape_and_kept(cpu_op):
    a, b = random_weight("Q4_1", 64, 2, 0), random_weight("Q4_1", 64, 2, 1)
    chosen = choose_routine(a)
    assert chosen in gguf_linear.ROUTINES and a.routine == chosen
    assert len(gguf_linear.choices) == 1
    assert choose_routine(b) == chosen and len(gguf_linear.choices) == 1


def test_a_routine_can_be_fixed(cpu_op, monkeypatch):
    monkeypatch.setenv("MINIPAGED_GGUF_ROUTINE", "dequant")
    w = random_weight("Q8_0", 16, 1, 0)
    assert choose_routine(w) == "dequant"
    monkeypatch.setenv("MINIPAGED_GGUF_ROUTINE", "fast")
    with pytest.raises(ValueError, match="MINIPAGED_GGUF_ROUTINE must be one of"):
        choose_routine(w)


def test_fused_rows_are_views_and_cat_checks_formats():
    q, k = random_weight("Q4_1", 8, 2, 0), random_weight("Q4_1", 4, 2, 1)
    whole = GGUFWeight.cat([q, k])
    parts = whole.split_rows([8, 4])
    assert parts[1].data_ptr() == whole.data_ptr() + 8 * whole.blocks.shape[1]
    assert torch.equal(parts[0].dequantize(), q.dequantize())
    assert torch.equal(whole.rows(torch.tensor([9, 0])),
                       torch.stack([k.dequantize()[1], q.dequantize()[0]]))
    with pytest.raises(ValueError, match="share their format"):
        GGUFWeight.cat([q, random_weight("Q8_0", 4, 2, 0)])


def test_the_cpp_op_refuses_bad_blocks(cpu_op):
    x, blocks = torch.randn(2, 32), torch.zeros(3, 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="block format 12 is not one this op reads"):
        cpu_op.module.gguf_linear(x, blocks, 12)
    with pytest.raises(RuntimeError, match="32 features need 34 bytes of blocks per row, got 20"):
        cpu_op.module.gguf_linear(x, blocks, 8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_op.module.gguf_linear(torch.randn(2, 31), blocks, 3)
    with pytest.raises(RuntimeError, match="x must be float32"):
        cpu_op.module.gguf_linear(x.double(), blocks, 3)
    with pytest.raises(RuntimeError, match="gguf_linear_tiled: 32 features need 34 bytes"):
        cpu_op.module.gguf_linear_tiled(x, blocks, 8)
    with pytest.raises(RuntimeError, match="gguf_linear_tiled: x must be \\(rows, in\\)"):
        cpu_op.module.gguf_linear_tiled(torch.randn(32), blocks, 3)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_a_weight_counts_its_weights_as_a_float_tensor_does(name):
    """lab/step_breakdown counts a linear layer's weights with ``numel()``."""
    weight = random_weight(name, out=3, blocks=2, seed=0)
    assert weight.numel() == weight.dequantize().numel() == 3 * 2 * FORMATS[name].weights


@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_the_cpp_op_gives_one_hot_rows_the_weights_bit_for_bit(cpu_op, name):
    """Each code unpacked right (Q5_0's fifth bits, nibble halves, K-quants' scales): one-hot
    input rows give back exactly the dequantized weights, in every tile of rows."""
    blocks = 1 if FORMATS[name].weights == 256 else 2
    weight = random_weight(name, out=5, blocks=blocks, seed=3)
    weight.use("cpp")
    got = weight.linear(torch.eye(weight.shape[1]))  # (in, out): row i is column i of W
    assert torch.equal(got.T, weight.dequantize())


@settings(max_examples=examples(40), deadline=None)
@given(name=st.sampled_from(gguf_linear.DEQUANTIZE_FORMATS), out=st.integers(1, 40),
       blocks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_the_cpp_op_dequantizes_bit_for_bit(cpu_op, name, out, blocks, seed):
    """The C++ op's float32 weights (the ``dequant`` routine's tiles) are those of
    ``kernels/gguf_blocks.py``, exactly; with float16 scales of every kind (subnormal,
    negative, zero) as well as a weight's size."""
    raw = torch.from_numpy(random_blocks(name, out, blocks, seed))
    # some blocks' scales drawn from every float16 bit pattern but inf and nan
    rng = torch.Generator().manual_seed(seed)
    halves = torch.randint(0, 0x7C00, (out, blocks), generator=rng, dtype=torch.int32)
    halves |= torch.randint(0, 2, (out, blocks), generator=rng, dtype=torch.int32) << 15
    as_bytes = torch.stack([halves & 0xFF, halves >> 8], -1).to(torch.uint8)
    view = raw.view(out, blocks, FORMATS[name].bytes)
    view[::2, :, 0:2] = as_bytes[::2]
    if name == "Q4_1":  # (and its m, in the other rows)
        view[1::2, :, 2:4] = as_bytes[1::2]
    got = cpu_op.module.gguf_dequantize(raw, FORMATS[name].ggml_type)
    assert torch.equal(got, GGUFWeight(raw, FORMATS[name]).dequantize())


def test_the_cpp_dequantize_refuses_bad_blocks(cpu_op):
    with pytest.raises(RuntimeError, match="block format 12 is not one this op reads"):
        cpu_op.module.gguf_dequantize(torch.zeros(2, 144, dtype=torch.uint8), 12)
    with pytest.raises(RuntimeError, match="not a whole number of 20-byte blocks"):
        cpu_op.module.gguf_dequantize(torch.zeros(2, 30, dtype=torch.uint8), 3)
    with pytest.raises(RuntimeError, match="contiguous uint8 CPU tensor"):
        cpu_op.module.gguf_dequantize(torch.zeros(2, 20), 3)


def test_a_step_of_many_rows_measures_its_routine_once(cpu_op, monkeypatch):
    monkeypatch.setattr(gguf_linear, "row_choices", {})
    weight = random_weight("Q4_1", 96, 4, 0)
    weight.use("cpp")
    x = torch.randn(40, weight.shape[1])
    first = weight.linear(x)
    assert list(gguf_linear.row_choices) == [(64, 96, 128, "Q4_1", torch.get_num_threads())]
    chosen = gguf_linear.row_choices[64, 96, 128, "Q4_1", torch.get_num_threads()]
    assert torch.equal(first, weight.linear(x, chosen))  # the chosen routine's result
    assert torch.equal(weight.linear(x[:33]), weight.linear(x[:33], chosen))  # same bucket
    assert len(gguf_linear.row_choices) == 1
    weight.linear(x[:1])  # one row: cpp, never measured
    assert len(gguf_linear.row_choices) == 1
    monkeypatch.setenv("MINIPAGED_GGUF_ROUTINE", "cpp")  # a fixed routine: every step
    assert torch.equal(weight.linear(x[:5]), weight.linear(x[:5], "cpp"))
    assert len(gguf_linear.row_choices) == 1


def test_a_learners_dequantization_is_what_dequant_runs(cpu_op, monkeypatch):
    """Lesson 18 puts the learner's Q4_1 in ``gguf_blocks``' place: the ``dequant`` routine
    then uses it, not the C++ op's."""
    from minipaged.kernels import gguf_blocks

    seen = []
    original = gguf_blocks.dequantize_q4_1

    def learners(blocks):
        seen.append(blocks.shape)
        return original(blocks)

    monkeypatch.setattr(gguf_blocks, "dequantize_q4_1", learners)
    weight = random_weight("Q4_1", 8, 2, 0)
    weight.linear(torch.randn(3, weight.shape[1]), "dequant")
    assert seen


class FakeCudaKernels:
    """Stands in for the CUDA op on this CPU: the right product, ``delay`` seconds a call."""

    def __init__(self, delay: float) -> None:
        self.delay, self.calls = delay, 0

    def gguf_linear(self, x, blocks, ggml_type):
        import time

        self.calls += 1
        time.sleep(self.delay)
        fmt = next(f for f in FORMATS.values() if f.ggml_type == ggml_type)
        return x @ dequantize(blocks, fmt).t()


def slow_dequant(monkeypatch, delay: float) -> None:
    original = GGUFWeight._float_rows

    def slow(self, part):
        import time

        time.sleep(delay)
        return original(self, part)

    monkeypatch.setattr(GGUFWeight, "_float_rows", slow)


def test_on_a_gpu_cuda_and_dequant_are_measured_per_shape(monkeypatch):
    """Where the CUDA kernels run (faked here), one row's routine is ``cuda`` or ``dequant``,
    whichever measured faster, once per shape."""
    slow_kernel = FakeCudaKernels(0.02)
    monkeypatch.setattr(gguf_linear, "_cuda_op", lambda device: slow_kernel)
    weight = random_weight("Q4_K", 16, 1, 0)
    assert weight.runs("cuda") and not weight.runs("cpp", torch.zeros(1, 256, dtype=torch.half))
    assert choose_routine(weight) == "dequant" and slow_kernel.calls > 0
    monkeypatch.setattr(gguf_linear, "choices", {})
    fast_kernel = FakeCudaKernels(0.0)
    monkeypatch.setattr(gguf_linear, "_cuda_op", lambda device: fast_kernel)
    slow_dequant(monkeypatch, 0.02)
    assert choose_routine(weight) == "cuda" and weight.routine == "cuda"
    calls = fast_kernel.calls
    assert choose_routine(random_weight("Q4_K", 16, 1, 1)) == "cuda"  # the same shape: kept
    assert fast_kernel.calls == calls and len(gguf_linear.choices) == 1
    x = torch.randn(1, 256)
    assert torch.equal(weight.linear(x), fast_kernel.gguf_linear(x, weight.blocks, 12))
    monkeypatch.setenv("MINIPAGED_GGUF_ROUTINE", "dequant")  # fixed: no measurement
    assert choose_routine(weight) == "dequant"


def test_on_a_gpu_a_step_of_many_rows_measures_cuda_against_dequant(monkeypatch):
    monkeypatch.setattr(gguf_linear, "row_choices", {})
    kernel = FakeCudaKernels(0.0)
    monkeypatch.setattr(gguf_linear, "_cuda_op", lambda device: kernel)
    slow_dequant(monkeypatch, 0.02)
    weight = random_weight("Q8_0", 24, 2, 0)
    weight.use("cuda")
    x = torch.randn(40, 64)
    assert torch.equal(weight.linear(x), kernel.gguf_linear(x, weight.blocks, 8))
    assert gguf_linear.row_choices == {(64, 24, 64, "Q8_0", torch.get_num_threads()): "cuda"}
    weight.linear(x[:33])  # the same bucket: not measured again
    assert len(gguf_linear.row_choices) == 1
    calls = kernel.calls
    weight.linear(torch.randn(gguf_linear.CPP_MAX_ROWS + 1, 64))  # a prompt: dequant, unmeasured
    assert kernel.calls == calls and len(gguf_linear.row_choices) == 1
    # the kernel slower than dequant (0.05 s against 0.02): dequant wins the next bucket
    monkeypatch.setattr(gguf_linear, "_cuda_op", lambda device: FakeCudaKernels(0.05))
    weight.linear(x[:3])
    assert gguf_linear.row_choices[4, 24, 64, "Q8_0", torch.get_num_threads()] == "dequant"
