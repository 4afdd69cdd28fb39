"""Lesson 15's checkers pass the solution, stop at plausible wrong answers with one short message,
and say "not done yet" for an unanswered exercise."""
import pytest

from minipaged.exercises import lesson15, not_done, solutions as S

pytestmark = pytest.mark.lesson15


def intensity_weights_per_sequence(dims, batch_size, context_len, dtype_bytes):
    flops = batch_size * (2 * dims.weight_params
                          + 4 * dims.num_layers * dims.num_heads * dims.head_size * context_len)
    moved = batch_size * (dims.weight_params * dtype_bytes
                          + context_len * dims.kv_bytes_per_token(dtype_bytes))
    return flops / moved  # each sequence reads the weights again: intensity never grows


def intensity_without_kv(dims, batch_size, context_len, dtype_bytes):
    flops = batch_size * (2 * dims.weight_params
                          + 4 * dims.num_layers * dims.num_heads * dims.head_size * context_len)
    return flops / (dims.weight_params * dtype_bytes)


def batch_ignoring_blocks(kv_budget_bytes, kv_bytes_per_token, block_size, seq_len):
    return kv_budget_bytes // (kv_bytes_per_token * seq_len)


def batch_as_a_float(kv_budget_bytes, kv_bytes_per_token, block_size, seq_len):
    return kv_budget_bytes / (kv_bytes_per_token * block_size) / -(-seq_len // block_size)


def steps_from_the_next_position(start, block_table, num_steps, block_size):
    return S.later_steps(start + 1, block_table + [0] * 2, num_steps, block_size)


def context_without_the_token(start, block_table, num_steps, block_size):
    return [(p, s, c - 1) for p, s, c in S.later_steps(start, block_table, num_steps, block_size)]


def slots_in_the_first_block(start, block_table, num_steps, block_size):
    return [(p, block_table[0] * block_size + p, p + 1) for p in range(start, start + num_steps)]


def one_step_only(start, block_table, num_steps, block_size):
    return S.later_steps(start, block_table, 1, block_size)


CASES = [
    (lesson15.check_decode_intensity, S.decode_intensity,
     [intensity_weights_per_sequence, intensity_without_kv]),
    (lesson15.check_max_batch_size, S.max_batch_size,
     [batch_ignoring_blocks, batch_as_a_float]),
    (lesson15.check_later_steps, S.later_steps,
     [steps_from_the_next_position, context_without_the_token, slots_in_the_first_block,
      one_step_only]),
]


@pytest.mark.parametrize("check, solution, wrong_answers", CASES,
                         ids=lambda c: getattr(c, "__name__", ""))
def test_checker_passes_the_solution_and_stops_at_wrong_answers(check, solution, wrong_answers,
                                                                 monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    assert check(solution).passed
    for wrong in wrong_answers:
        result = check(wrong)
        assert result.status == "failed", wrong.__name__
        assert "hint:" in result and "expected:" in result
        assert result.count("\n") <= 5  # one short message


@pytest.mark.parametrize("check", [c for c, _, _ in CASES], ids=lambda c: c.__name__)
def test_unanswered_says_not_done_without_raising(check, monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)

    def unanswered(*args):
        not_done()

    assert check(unanswered).status == "not done"
    monkeypatch.setenv("MINIPAGED_SOLUTIONS", "1")
    assert check(unanswered).status == "solution used"


def test_the_hints_name_the_mistake(monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    assert "once per step" in lesson15.check_decode_intensity(intensity_weights_per_sequence)
    assert "KV cache is read" in lesson15.check_decode_intensity(intensity_without_kv)
    assert "whole blocks" in lesson15.check_max_batch_size(batch_ignoring_blocks)
