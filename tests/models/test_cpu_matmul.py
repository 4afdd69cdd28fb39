"""A linear layer's matmul on the CPU runs by the routine this machine ran fastest for the shape
(``models/cpu_matmul.py``: x W^T, (W x^T)^T or oneDNN): the same numbers every way, one
measurement per shape, and the engine's tokens unchanged."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from minipaged import LLM, SamplingParams
from minipaged.models import cpu_matmul


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "choices", {})
    monkeypatch.delenv("MINIPAGED_LINEAR_FORM", raising=False)


def rel_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 1300), inp=st.integers(1, 96), out=st.integers(1, 96),
       bias=st.booleans(), form=st.sampled_from(["xw", "wx", "onednn", ""]),
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
    for rows in (64, 40, 33, 64, 7, 5, 8):  # 33..64 share a bucket, 5..8 another
        cpu_matmul.linear(torch.randn(rows, 32), w)
    assert measured == [(64, (48, 32)), (7, (48, 32))]
    threads = torch.get_num_threads()
    assert set(cpu_matmul.choices) == {(64, 48, 32, torch.float32, threads),
                                       (8, 48, 32, torch.float32, threads)}
    assert set(cpu_matmul.choices.values()) <= set(cpu_matmul.ROUTINES)
    cpu_matmul.linear(torch.randn(3000, 32), w)  # every large step: one shape
    cpu_matmul.linear(torch.randn(1500, 32), w)
    assert measured[2:] == [(3000, (48, 32))]
    cpu_matmul.linear(torch.randn(0, 32), w)  # no rows: nothing to measure
    cpu_matmul.linear(torch.randn(1, 32), w)  # one row: F.linear
    cpu_matmul.linear(torch.randn(2, 3, 32), w)  # 3-D: F.linear as it is
    assert len(measured) == 3
    with torch.enable_grad():  # autograd: F.linear as it is
        cpu_matmul.linear(torch.randn(100, 32), w.requires_grad_())
    assert len(measured) == 3


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


def test_a_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv("MINIPAGED_LINEAR_FORM", "transposed")
    with pytest.raises(ValueError, match="MINIPAGED_LINEAR_FORM must be one of \\['onednn', "
                                         "'wx', 'xw'\\] .or unset., got 'transposed'"):
        cpu_matmul.linear(torch.randn(4, 8), torch.randn(8, 8))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v with a bias
def test_the_engine_s_tokens_do_not_depend_on_the_form(tmp_path, monkeypatch, kind):
    from tiny_models import greedy_reference, pick_prompts, save_tiny_model

    hf = save_tiny_model(kind, tmp_path, seed=3)
    prompts = pick_prompts(hf, [9, 14, 6], 8, seed=1)
    want = [greedy_reference(hf, p, 8) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for form in ("xw", "wx", "onednn", ""):
        monkeypatch.setenv("MINIPAGED_LINEAR_FORM", form)
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, form
