"""Lesson 06's checkers: each passes the solution, fails a plausible wrong answer in a few lines
with a hint that does not state the code, and says "not done yet" for an unanswered exercise."""
import ast
import inspect

import numpy as np
import pytest

from minipaged.exercises import lesson06, not_done
from minipaged.exercises import solutions as S

pytestmark = pytest.mark.lesson06


def blocks_ignoring_start(warp, start, end, block_size):
    return list(range(warp, -(-end // block_size), 4))  # V1's blocks, whatever the partition


def blocks_rounded_down(warp, start, end, block_size):
    return [start // block_size + b for b in range(warp, (end - start) // block_size, 4)]


def combine_by_averaging(max_logits, exp_sums, outs):
    return outs.mean(0)


def combine_without_the_max(max_logits, exp_sums, outs):
    return exp_sums @ outs / exp_sums.sum()


def combine_without_a_common_max(max_logits, exp_sums, outs):
    """Right in exact arithmetic; float64's exp overflows past logits of about 709."""
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        weights = exp_sums * np.exp(max_logits)
        return weights @ outs / weights.sum()


CHECKS = [
    (lesson06.check_warp_blocks, S.warp_blocks, [blocks_ignoring_start, blocks_rounded_down]),
    (lesson06.check_combine_partitions, S.combine_partitions,
     [combine_by_averaging, combine_without_the_max, combine_without_a_common_max]),
]


@pytest.mark.parametrize("check, solution, wrong", CHECKS, ids=lambda v: getattr(v, "__name__", ""))
def test_checker_passes_the_solution(check, solution, wrong, monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    for seed in (0, 1, 2):
        result = check(solution, seed=seed)
        assert result.passed and "✓" in result


@pytest.mark.parametrize("check, solution, wrong", CHECKS, ids=lambda v: getattr(v, "__name__", ""))
def test_checker_fails_wrong_answers_in_a_few_lines(check, solution, wrong, capsys):
    for fn in wrong:
        capsys.readouterr()
        result = check(fn)
        assert result.status == "failed" and not result.passed
        message = str(result)
        assert "case" in message and "hint:" in message and "expected:" in message
        assert "yours:" in message and len(message.splitlines()) <= 6
        assert capsys.readouterr().out == message + "\n"


@pytest.mark.parametrize("check, solution, wrong", CHECKS, ids=lambda v: getattr(v, "__name__", ""))
def test_checker_says_not_done_yet(check, solution, wrong, monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)

    def unanswered(*args):
        not_done()

    result = check(unanswered)
    assert result.status == "not done" and "not done yet" in result


def test_hints_point_at_the_idea_without_stating_the_code():
    code = ["//", " % ", "ceil(", "range(", "np.exp(", "max_logits", "@"]
    for node in ast.walk(ast.parse(inspect.getsource(lesson06))):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "hint"
                                                for t in node.targets):
            hint = "".join(part.value for part in ast.walk(node.value)
                           if isinstance(part, ast.Constant) and isinstance(part.value, str))
            assert not [c for c in code if c in hint], hint


def test_the_solutions_agree_with_the_real_kernels_loop():
    from minipaged.lab import emulator as emu

    for start, end in [(0, 37), (512, 1100), (0, 1)]:
        for warp in range(4):
            assert S.warp_blocks(warp, start, end, 16) == emu.warp_blocks(warp, start, end, 16)
    assert np.isfinite(S.combine_partitions(np.array([1.0, 900.0]), np.array([2.0, 3.0]),
                                            np.ones((2, 4)))).all()


def test_combining_without_one_common_maximum_fails_on_logits_past_floats_range():
    result = lesson06.check_combine_partitions(combine_without_a_common_max)
    assert result.status == "failed" and "overflow" in result


def test_the_kernels_own_helpers_are_found_in_code_not_in_comments():
    from minipaged.exercises import softmax_phase_hints as hints

    code = ("  // block_reduce<NUM_WARPS, G>(qk_max, ...) would do it\n"
            "  /* butterfly<16, 1>(v, op) */\n"
            "  float m = butterfly <16, G>(qk_max, MaxOp());\n")
    assert [name for name, _ in hints.helpers_called(code)] == ["butterfly", "MaxOp"]
    assert hints.helpers_called("  float m = my_block_reduce(qk_max);\n") == []
    assert "hint: this exercise asks for the two reductions written by you" in \
        hints.refusal(hints.helpers_called(code))


def test_calling_the_kernels_block_reduce_is_refused_before_building():
    from minipaged.exercises import workbench

    code = "  const float max_logit = block_reduce<NUM_WARPS, G>(qk_max, red_smem, -FLT_MAX, MaxOp());\n"
    result = workbench.check_component("softmax_phase_cuda", code, save=False)
    assert result.status == "failed" and "refused before building" in result
    assert "block_reduce (csrc/paged_attention_common.cuh)" in result
