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


# -- dequantize_q4_1: a GGUF weight block, a build-track component -------------------------------
def _learner_dequantize_q4_1():
    """scripts/learner_answers/lesson18.py's answer, its helper cells run first."""
    from pathlib import Path

    from repo_paths import ROOT

    namespace = {"torch": torch}
    exec((Path(ROOT) / "scripts" / "learner_answers" / "lesson18.py").read_text(), namespace)
    return namespace["dequantize_q4_1"]


def test_the_q4_1_check_passes_both_answers(tmp_path, monkeypatch):
    """(The learner's, run from a string here, has no source to save: the lesson's run with
    scripts/answer_lessons.py saves it.)"""
    from minipaged.exercises import workbench

    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path))
    result = workbench.check_component("dequantize_q4_1", S.dequantize_q4_1)
    assert result.status == "passed", result
    assert (tmp_path / "dequantize_q4_1.py").exists()
    result = workbench.check_component("dequantize_q4_1", _learner_dequantize_q4_1(), save=False)
    assert result.status == "passed", result


def test_the_q4_1_stub_is_not_done(tmp_path, monkeypatch):
    from minipaged.exercises import workbench

    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path))
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)

    def dequantize_q4_1(blocks):
        not_done()

    assert workbench.check_component("dequantize_q4_1", dequantize_q4_1).status == "not done"


def test_a_learners_q4_1_plugged_in_is_what_the_gguf_weights_use(tmp_path, monkeypatch):
    """Inside ``plugged_in`` every Q4_1 dequantization of the package runs the learner's."""
    from minipaged.exercises import workbench
    from minipaged.kernels import gguf_blocks

    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path))
    calls = []

    def counted(blocks):
        calls.append(blocks.shape[0])
        return S.dequantize_q4_1(blocks)

    assert workbench.check_component("dequantize_q4_1", counted, save=False).passed
    rows = torch.randint(0, 256, (3, 40), dtype=torch.uint8)
    rows[:, [0, 1, 20, 21]] = 0x3C  # (finite scales)
    rows[:, [2, 3, 22, 23]] = 0x00
    calls.clear()
    with workbench.plugged_in("dequantize_q4_1", quiet=True):
        got = gguf_blocks.dequantize(rows, gguf_blocks.FORMATS["Q4_1"])
    assert calls == [6]
    assert torch.equal(got, gguf_blocks.dequantize(rows, gguf_blocks.FORMATS["Q4_1"]))
