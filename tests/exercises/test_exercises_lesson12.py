"""Lesson 12's checkers pass the solutions, stop at plausible wrong answers with one short
message, and say "not done yet" for an unanswered exercise."""
import pytest
import torch

from minipaged.exercises import lesson12, not_done, solutions as S

pytestmark = pytest.mark.lesson12


def verify_without_the_extra_token(target_argmax_ids, draft_token_ids):
    return S.greedy_verify(target_argmax_ids, draft_token_ids)[:-1]  # forgot the correction


def verify_all_drafts(target_argmax_ids, draft_token_ids):
    # counts every matching draft, even after a mismatch
    kept = [d for d, t in zip(draft_token_ids, target_argmax_ids) if d == t]
    return kept + [target_argmax_ids[len(kept)]]


def verify_draft_as_correction(target_argmax_ids, draft_token_ids):
    out = S.greedy_verify(target_argmax_ids, draft_token_ids)
    k = len(draft_token_ids)
    return out if len(out) == k + 1 else out[:-1] + [draft_token_ids[len(out) - 1]]


def residual_unnormalised(p, q):
    return (p - q).clamp(min=0)


def residual_negative(p, q):
    return (p - q) / (p - q).abs().sum()


def residual_is_p(p, q):
    return p.clone()


def unanswered(*args):
    not_done()


@pytest.mark.parametrize("check, solution, wrong, hint_word", [
    (lesson12.check_greedy_verify, S.greedy_verify, verify_without_the_extra_token, "one token more"),
    (lesson12.check_greedy_verify, S.greedy_verify, verify_all_drafts, "first draft"),
    (lesson12.check_greedy_verify, S.greedy_verify, verify_draft_as_correction, "target's token"),
    (lesson12.check_residual_distribution, S.residual_distribution, residual_unnormalised, "sums to 1"),
    (lesson12.check_residual_distribution, S.residual_distribution, residual_negative, "negative"),
    (lesson12.check_residual_distribution, S.residual_distribution, residual_is_p, "not already cover"),
])
def test_checker_passes_the_solution_and_stops_at_a_wrong_answer(check, solution, wrong,
                                                                  hint_word, capsys):
    assert check(solution).status == "passed"
    result = check(wrong)
    assert result.status == "failed" and hint_word in result, result
    assert len(result.splitlines()) <= 5
    assert capsys.readouterr().out.count("✗") == 1  # printed once


@pytest.mark.parametrize("check", [lesson12.check_greedy_verify,
                                   lesson12.check_residual_distribution])
def test_unanswered_says_not_done(check, monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    assert check(unanswered).status == "not done"
    monkeypatch.setenv("MINIPAGED_SOLUTIONS", "1")
    assert check(unanswered).status == "solution used"


def test_the_solutions_agree_with_the_package_on_the_edges():
    from minipaged.spec_decode import rejection_sampler as rs

    assert S.greedy_verify([5, 6], [5]) == rs.greedy_verify([5, 6], [5]) == [5, 6]
    assert S.greedy_verify([4, 6], [5]) == rs.greedy_verify([4, 6], [5]) == [4]
    p, q = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, 0.5, 0.5])
    assert torch.allclose(S.residual_distribution(p, q), rs.residual_distribution(p, q))
    assert torch.allclose(S.residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
