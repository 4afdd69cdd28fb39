"""A linear layer's matmul on the CPU runs by the routine this machine ran fastest for the shape
(``models/cpu_matmul.py``: x W^T, (W x^T)^T, oneDNN or minipaged's C++ loop): the same numbers
every way, one measurement per shape, and the engine's tokens unchanged."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from minipaged import LLM, SamplingParams
from minipaged.kernels import build
from minipaged.models import cpu_matmul


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "choices", {})
    monkeypatch.delenv("MINIPAGED_LINEAR_FORM", raising=False)


def rel_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 1300), inp=st.integers(1, 96), out=st.integers(1, 96),
       bias=st.booleans(), form=st.sampled_from(["xw", "wx", "onednn", "cpp", ""]),
       seed=st.integers(0, 2**16))
def test_every_form_gives_f_linear(rows, inp, out, bias, form, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inp, generator=gen)
    w = torch.randn(out, inp, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    with pytest.MonkeyPatch.context() as mp:
        if form:
            mp.setenv("MINIPAGED_LINEAR_FORM", form)
        with torch.inference_mode():
            got = cpu_matmul.linear(x, w, b)
    want = F.linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    assert rel_error(got, want) < 1e-5


@torch.inference_mode()
def test_one_measurement_per_shape_then_the_choice_is_kept(monkeypatch):
    measured = []
    real = cpu_matmul._fastest

    def spy(x, w):
        measured.append((x.shape[0], tuple(w.shape)))
        return real(x, w)

    monkeypatch.setattr(cpu_matmul, "_fastest", spy)
    w = torch.randn(48, 32)
    for rows in (64, 60, 49, 40, 33, 48, 7, 8):  # buckets: 49..64, 33..48, 7..8
        cpu_matmul.linear(torch.randn(rows, 32), w)
    assert measured == [(64, (48, 32)), (40, (48, 32)), (7, (48, 32))]
    threads, op = torch.get_num_threads(), build.CPU_OP.ready() is not None
    assert set(cpu_matmul.choices) == {(b, 48, 32, torch.float32, threads, op)
                                       for b in (64, 48, 8)}
    assert set(cpu_matmul.choices.values()) <= set(cpu_matmul.ROUTINES)
    cpu_matmul.linear(torch.randn(3000, 32), w)  # every large step: one shape
    cpu_matmul.linear(torch.randn(1500, 32), w)
    assert measured[3:] == [(3000, (48, 32))]
    cpu_matmul.linear(torch.randn(0, 32), w)  # no rows: nothing to measure
    cpu_matmul.linear(torch.randn(1, 32), w)  # one row: cpp where loaded, else F.linear
    cpu_matmul.linear(torch.randn(2, 3, 32), w)  # 3-D: F.linear as it is
    assert len(measured) == 4
    with torch.enable_grad():  # autograd: F.linear as it is
        cpu_matmul.linear(torch.randn(100, 32), w.requires_grad_())
    assert len(measured) == 4


def test_the_buckets_are_powers_of_two_and_the_steps_halfway():
    assert [cpu_matmul._bucket(r) for r in range(1, 18)] == [
        1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, 24]
    for rows in range(1, 3 * cpu_matmul.MAX_ROWS):
        bucket = cpu_matmul._bucket(rows)
        assert bucket >= min(rows, cpu_matmul.MAX_ROWS + 1)
        assert bucket < 2 * rows  # (never more than twice the rows it stands for)
    assert cpu_matmul._bucket(cpu_matmul.MAX_ROWS + 1) == cpu_matmul._bucket(10**6)


@torch.inference_mode()
def test_the_fastest_routine_is_the_one_kept(monkeypatch):
    """Whatever the measurement says is what runs (routines made slower lose; one that fails,
    as a routine missing from a build of torch would, is left out)."""
    import time

    def slow(routine):
        return lambda x, w: (time.sleep(0.002), routine(x, w))[1]

    def missing(x, w):
        raise RuntimeError("no such operator")

    monkeypatch.setattr(cpu_matmul, "ROUTINES", {"xw": slow(cpu_matmul._xw),
                                                  "wx": cpu_matmul._wx, "onednn": missing})
    cpu_matmul.linear(torch.randn(16, 8), torch.randn(8, 8))
    assert list(cpu_matmul.choices.values()) == ["wx"]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 300), inp=st.integers(1, 200), out=st.integers(1, 140),
       gap=st.integers(0, 9), seed=st.integers(0, 2**16))
def test_the_cpp_loop_gives_f_linear(cpu_op, rows, inp, out, gap, seed):
    """Any shape (features not a multiple of 8, outputs not of 4), rows a slice of wider ones."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inp + gap, generator=gen)[:, :inp]  # rows `gap` floats apart
    w = torch.randn(out, inp, generator=gen)
    got, want = cpu_op.linear(x, w), F.linear(x, w)
    assert got.shape == want.shape and got.is_contiguous()
    if rows:  # (to the size of the products summed: one output may be a near cancellation)
        scale = (x.abs() @ w.abs().t()).max()
        assert float((got - want).abs().max() / scale) < 1e-5


def test_a_row_s_result_does_not_depend_on_the_batch_or_the_threads(cpu_op):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 100, generator=gen), torch.randn(70, 100, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([cpu_op.linear(x[i:i + 1], w) for i in range(37)])
        torch.set_num_threads(2)
        together = cpu_op.linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, 11), inp=st.integers(1, 40), out=st.integers(1, 9),
       seed=st.integers(0, 2**16))
def test_a_row_s_result_is_the_same_in_every_tile_shape(cpu_op, rows, inp, out, seed):
    # Every k % 8 tail and every tile shape (3 or 1 weight rows, 4 or 1 input rows): the compiler
    # is not left to fuse a multiply-add in one shape and not in another (an AVX-512 Xeon did).
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, inp, generator=gen), torch.randn(out, inp, generator=gen)
    alone = torch.cat([cpu_op.linear(x[i:i + 1], w) for i in range(rows)])
    assert torch.equal(alone, cpu_op.linear(x, w))


def test_the_cpp_loop_names_bad_input(cpu_op):
    x, w = torch.randn(4, 6), torch.randn(5, 6)
    with pytest.raises(RuntimeError, match="float32 only, got x BFloat16"):
        cpu_op.linear(x.bfloat16(), w)
    with pytest.raises(RuntimeError, match="x has 5 features but weight takes 6"):
        cpu_op.linear(torch.randn(4, 5), w)
    with pytest.raises(RuntimeError, match=r"x must be \(rows, in\)"):
        cpu_op.linear(torch.randn(6), w)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        cpu_op.linear(torch.randn(4, 6), torch.randn(6, 6).t())
    assert torch.equal(cpu_op.linear(x.t().contiguous().t(), w), cpu_op.linear(x, w))


@torch.inference_mode()
def test_the_cpp_loop_is_measured_only_where_it_can_run(cpu_op, monkeypatch):
    """A candidate for a few rows where the op is loaded: chosen when fastest; never for more than
    CPP_MAX_ROWS rows; left out (and a forced ``cpp`` runs F.linear) while the op is not loaded."""
    import time

    def slow(routine):
        return lambda x, w: (time.sleep(0.002), routine(x, w))[1]

    monkeypatch.setattr(cpu_matmul, "ROUTINES", {"xw": slow(cpu_matmul._xw),
                                                  "wx": slow(cpu_matmul._wx),
                                                  "cpp": cpu_matmul._cpp})
    w = torch.randn(24, 16)
    cpu_matmul.linear(torch.randn(16, 16), w)
    cpu_matmul.linear(torch.randn(cpu_matmul.CPP_MAX_ROWS + 1, 16), w)
    by_rows = {key[0]: name for key, name in cpu_matmul.choices.items()}
    assert by_rows[16] == "cpp"
    assert by_rows[cpu_matmul._bucket(cpu_matmul.CPP_MAX_ROWS + 1)] != "cpp"
    x = torch.randn(16, 16)
    with pytest.MonkeyPatch.context() as mp:  # loaded, but not for bfloat16: F.linear
        mp.setenv("MINIPAGED_LINEAR_FORM", "cpp")
        xb, wb = x.bfloat16(), w.bfloat16()
        assert torch.equal(cpu_matmul.linear(xb, wb), F.linear(xb, wb))
    monkeypatch.setattr(build.CPU_OP, "ready", lambda: None)  # (compiling, or switched off)
    assert torch.allclose(cpu_matmul.linear(x, w), F.linear(x, w))
    assert len(cpu_matmul.choices) == 3  # measured again, without the C++ loop
    assert list(cpu_matmul.choices.values()).count("cpp") == 1
    monkeypatch.setenv("MINIPAGED_LINEAR_FORM", "cpp")
    assert torch.equal(cpu_matmul.linear(x, w), F.linear(x, w))
    assert torch.equal(cpu_matmul.linear(x[:1], w), F.linear(x[:1], w))


@torch.inference_mode()
def test_one_row_takes_the_cpp_loop_where_it_is_loaded(cpu_op, monkeypatch):
    x, w = torch.randn(1, 40), torch.randn(30, 40)
    ran = []
    monkeypatch.setattr(cpu_op, "linear", lambda *a: ran.append(1) or F.linear(*a))
    got = cpu_matmul.linear(x, w, torch.ones(30))
    assert ran == [1] and torch.allclose(got, F.linear(x, w, torch.ones(30)))
    assert not cpu_matmul.choices  # (nothing measured)
    monkeypatch.setenv("MINIPAGED_LINEAR_FORM", "xw")  # a setting wins
    cpu_matmul.linear(x, w)
    assert ran == [1]


def test_a_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv("MINIPAGED_LINEAR_FORM", "transposed")
    with pytest.raises(ValueError, match="MINIPAGED_LINEAR_FORM must be one of \\['cpp', "
                                         "'onednn', 'wx', 'xw'\\] .or unset., got 'transposed'"):
        cpu_matmul.linear(torch.randn(4, 8), torch.randn(8, 8))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v with a bias
def test_the_engine_s_tokens_do_not_depend_on_the_form(tmp_path, monkeypatch, kind):
    from tiny_models import greedy_reference, pick_prompts, save_tiny_model

    hf = save_tiny_model(kind, tmp_path, seed=3)
    prompts = pick_prompts(hf, [9, 14, 6], 8, seed=1)
    want = [greedy_reference(hf, p, 8) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for form in ("xw", "wx", "onednn", "cpp", ""):
        monkeypatch.setenv("MINIPAGED_LINEAR_FORM", form)
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, form
