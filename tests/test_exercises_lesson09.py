"""Lesson 09's checkers: each passes the solution, fails plausible wrong answers with a short
message, and says "not done yet" for an unanswered exercise."""
import pytest

from minipaged.exercises import lesson09, not_done, solutions as S

pytestmark = pytest.mark.lesson09


# ---- plausible wrong answers -------------------------------------------------------------------
def chunks_ignoring_decodes(budget, num_decodes, tokens_left):
    return S.prefill_chunks(budget, 0, tokens_left)  # the decodes' tokens not counted


def chunks_only_the_first_prompt(budget, num_decodes, tokens_left):
    got = S.prefill_chunks(budget, num_decodes, tokens_left)
    return got[:1] + [0] * (len(got) - 1)  # a second prompt never shares a step


def chunks_with_negative_budget(budget, num_decodes, tokens_left):
    left = budget - num_decodes
    out = []
    for need in tokens_left:
        out.append(min(need, left))  # negative when the decodes overspent the budget
        left -= max(out[-1], 0)
    return out


def first_steps_without_new_decodes(budget, num_decodes, prompt_lens):
    left, steps, step = list(prompt_lens), [0] * len(prompt_lens), 0
    while not all(steps):  # a prompt that sampled never takes its decode token
        step += 1
        todo = [i for i, s in enumerate(steps) if not s]
        for i, take in zip(todo, S.prefill_chunks(budget, num_decodes, [left[i] for i in todo])):
            left[i] -= take
            if left[i] == 0:
                steps[i] = step
    return steps


def first_steps_zero_based(budget, num_decodes, prompt_lens):
    return [s - 1 for s in S.first_token_steps(budget, num_decodes, prompt_lens)]


CASES = [(lesson09.check_prefill_chunks, S.prefill_chunks,
          [chunks_ignoring_decodes, chunks_only_the_first_prompt, chunks_with_negative_budget]),
         (lesson09.check_first_token_steps, S.first_token_steps,
          [first_steps_without_new_decodes, first_steps_zero_based])]


@pytest.mark.parametrize("check, solution, wrong", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_checker_passes_the_solution_and_fails_wrong_answers(check, solution, wrong, capsys,
                                                             monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    for seed in (0, 1):
        assert check(solution, seed=seed).passed
    for fn in wrong:
        capsys.readouterr()
        result = check(fn)
        message = str(result)
        assert result.status == "failed", fn.__name__
        assert "yours:" in message and "expected:" in message and "hint:" in message
        assert len(message.splitlines()) <= 6 and "Traceback" not in message
        assert capsys.readouterr().out == message + "\n"


@pytest.mark.parametrize("check", [lesson09.check_prefill_chunks, lesson09.check_first_token_steps])
def test_unanswered_says_not_done(check, monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    result = check(lambda *args: not_done())
    assert result.status == "not done" and "not done yet" in result
    monkeypatch.setenv("MINIPAGED_SOLUTIONS", "1")
    assert "solution was used" in check(lambda *args: not_done())


def test_random_steps_cover_overspent_budgets_and_shared_steps():
    """The cases hold decodes that use the whole budget, and steps where two prompts share it."""
    from minipaged.exercises.checking import rng_for

    cases = list(lesson09._random_steps(rng_for(0), 300))
    assert any(decodes >= budget for budget, decodes, _, _ in cases)
    assert any(sum(1 for n in expected if n) >= 2 for _, _, _, expected in cases)
    assert any(0 < e < left for _, _, lefts, exp in cases for e, left in zip(exp, lefts))


def test_first_token_steps_of_a_lone_prompt_is_a_ceiling():
    assert lesson09.first_token_steps_of_scheduler(budget=6, num_decodes=2, prompt_lens=[9]) == [3]
    assert lesson09.first_token_steps_of_scheduler(6, 2, [8, 1]) == [2, 3]
