"""Lesson 18's checker passes the solution, stops at plausible wrong quantizers with one short
message and a hint that names the mistake, and says "not done yet" for an unanswered exercise."""
import pytest
import torch

from minipaged.exercises import lesson18, not_done, solutions as S

pytestmark = pytest.mark.lesson18

LARGEST = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def inverse_scale(x, fmt):
    dtype, largest = LARGEST[fmt]
    amax = float(x.abs().max()) or 1.0
    scale = largest / amax  # the reciprocal: codes = x * scale
    return (x * scale).clamp(-largest, largest).round().to(dtype), scale


def zero_scale_for_zeros(x, fmt):
    dtype, largest = LARGEST[fmt]
    scale = torch.tensor(float(x.abs().max())) / largest
    y = torch.nan_to_num(x / scale).clamp(-largest, largest)
    return (torch.round(y) if fmt == "int8" else y).to(dtype), float(scale)


def truncating_int8(x, fmt):
    codes, scale = S.quantize_vector(x, fmt)
    if fmt == "int8":
        dtype, largest = LARGEST[fmt]
        codes = (x / torch.tensor(scale)).clamp(-largest, largest).to(dtype)  # truncates
    return codes, scale


@pytest.mark.parametrize("wrong, words", [(inverse_scale, "back into x"),
                                          (zero_scale_for_zeros, "all-zero vector"),
                                          (truncating_int8, "round half to even")])
def test_checker_passes_the_solution_and_names_each_mistake(monkeypatch, wrong, words):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    assert lesson18.check_quantize_vector(S.quantize_vector).passed
    result = lesson18.check_quantize_vector(wrong)
    assert result.status == "failed" and "hint:" in result and words in result
    assert result.count("\n") <= 5  # one short message


def test_unanswered_says_not_done_without_raising(monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)

    def unanswered(*args):
        not_done()

    assert lesson18.check_quantize_vector(unanswered).status == "not done"
    monkeypatch.setenv("MINIPAGED_SOLUTIONS", "1")
    assert lesson18.check_quantize_vector(unanswered).status == "solution used"
