"""Lesson 10's exercise checkers: they pass the answers, stop plausible wrong answers with a short
message and the right hint, and say "not done yet"; the top-p answer keeps its interface (the
capstone plugs it in) and every rule the checkers hold is in the exercise text."""
import json

import pytest
import torch

from minipaged.exercises import lesson10, not_done, solutions as S
from minipaged.worker.sampler import top_k_top_p_filter
from repo_paths import ROOT

pytestmark = pytest.mark.lesson10



# ---- plausible wrong answers -------------------------------------------------------------------
def _drop(logits, drop_sorted, order):
    drop = torch.zeros_like(drop_sorted)
    drop[order] = drop_sorted
    return logits.masked_fill(drop, float("-inf"))


def top_p_drops_the_crossing_token(logits, top_p):
    if top_p >= 1.0:
        return logits.clone()
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = torch.cumsum(probs, dim=-1) > top_p  # the token that reaches top_p is dropped too
    drop[0] = False
    return _drop(logits, drop, order)


def top_p_keeps_one_too_many(logits, top_p):
    if top_p >= 1.0:
        return logits.clone()
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    drop = torch.zeros_like(before, dtype=torch.bool)
    drop[1:] = before[:-1] >= top_p  # one token late
    return _drop(logits, drop, order)


def top_p_returns_probabilities(logits, top_p):
    return torch.softmax(S.top_p_filter(logits, top_p), dim=-1)  # renormalised: not logits


def top_p_without_sorting(logits, top_p):
    probs = torch.softmax(logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # in vocabulary order
    drop = before >= top_p
    drop[0] = False
    return logits.masked_fill(drop, float("-inf"))


def beam_best_token_per_beam(cum_logprobs, logprobs, width):
    if len(cum_logprobs) == 1:
        return S.beam_step(cum_logprobs, logprobs, width)
    return [(b, int(torch.argmax(logprobs[b]))) for b in range(len(cum_logprobs))]


def beam_without_cumulative(cum_logprobs, logprobs, width):
    return S.beam_step([0.0] * len(cum_logprobs), logprobs, width)


def beam_worst_first(cum_logprobs, logprobs, width):
    return S.beam_step(cum_logprobs, logprobs, width)[::-1]


WRONG = [
    (lesson10.check_top_p_filter, top_p_drops_the_crossing_token, "smallest set"),
    (lesson10.check_top_p_filter, top_p_keeps_one_too_many, "already reach top_p"),
    (lesson10.check_top_p_filter, top_p_returns_probabilities, "stay exactly as they were"),
    (lesson10.check_top_p_filter, top_p_without_sorting, ""),
    (lesson10.check_beam_step, beam_best_token_per_beam, "compete together"),
    (lesson10.check_beam_step, beam_without_cumulative, ""),
    (lesson10.check_beam_step, beam_worst_first, "best first"),
]


@pytest.mark.parametrize("check, solution", [(lesson10.check_top_p_filter, S.top_p_filter),
                                             (lesson10.check_beam_step, S.beam_step)])
def test_checker_passes_the_answer_on_several_seeds(check, solution, monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    for seed in (0, 1, 2, 3):
        result = check(solution, seed=seed)
        assert result.passed and "✓" in result


@pytest.mark.parametrize("check, wrong, hint", WRONG, ids=[w[1].__name__ for w in WRONG])
def test_checker_stops_a_wrong_answer_with_a_short_message(check, wrong, hint, capsys,
                                                           monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    capsys.readouterr()
    result = check(wrong)  # does not raise
    message = str(result)
    assert result.status == "failed", message
    assert "case" in message and "yours:" in message and "expected:" in message
    assert "hint:" in message and hint in message.split("hint:")[1], message
    assert len(message.splitlines()) <= 6 and "Traceback" not in message
    assert capsys.readouterr().out == message + "\n"


@pytest.mark.parametrize("check", [lesson10.check_top_p_filter, lesson10.check_beam_step])
def test_unanswered_says_not_done_unless_solutions_are_allowed(check, monkeypatch):
    def unanswered(*args):
        not_done()

    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    assert check(unanswered).status == "not done"
    monkeypatch.setenv("MINIPAGED_SOLUTIONS", "1")
    assert "solution was used" in check(unanswered)


def test_a_wrong_shape_or_type_is_a_message_not_an_exception(monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    assert lesson10.check_top_p_filter(lambda logits, top_p: logits[:1]).status == "failed"
    assert lesson10.check_top_p_filter(lambda logits, top_p: None).status == "failed"
    assert lesson10.check_beam_step(lambda c, lp, w: 3).status == "failed"
    assert lesson10.check_beam_step(lambda c, lp, w: [(0, 0)]).status == "failed"


def test_top_p_answer_keeps_the_capstone_interface():
    """``top_p_filter(logits, top_p)``: (vocab,) in, (vocab,) out, equal to the package's
    ``top_k_top_p_filter`` with top-k off, on a real-sized vocabulary with -inf entries."""
    generator = torch.Generator().manual_seed(0)
    for top_p in (1e-6, 0.1, 0.5, 0.9, 0.999, 1.0):
        logits = torch.randn(49152, generator=generator) * 3  # (V,)
        logits[:100] = float("-inf")
        got = S.top_p_filter(logits.clone(), top_p)
        assert got.shape == logits.shape and got.dtype == logits.dtype
        assert torch.equal(got, top_k_top_p_filter(logits, -1, top_p))
        assert torch.isfinite(got).any()


def test_later_cells_use_the_package_filter_until_the_learners_passes(monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)

    def mine(logits, top_p):
        return S.top_p_filter(logits, top_p)

    assert lesson10.usable(mine) is not mine
    assert lesson10.check_top_p_filter(mine).passed
    assert lesson10.usable(mine) is mine


def test_package_beam_step_agrees_with_a_plain_search():
    """The checker's expected answer (from ``Sampler._beam_search``) is the best ``width``
    scores of all beams, best first."""
    rng = lesson10.rng_for(5)
    for case in range(40):
        cum, logprobs, width = lesson10._beam_case(rng, case)
        scores = torch.tensor(cum)[:, None] + logprobs  # (B, V)
        flat = sorted(((float(scores[b, t]), (b, t)) for b in range(scores.shape[0])
                       for t in range(scores.shape[1])), reverse=True)
        assert lesson10.package_beam_step(cum, logprobs, width) == [c for _, c in flat[:width]]


def _exercise_text() -> str:
    cells = json.loads((ROOT / "lessons" / "10_sampling.ipynb").read_text())["cells"]
    return "".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def test_every_rule_the_checkers_hold_is_in_the_exercise_text():
    text = " ".join(_exercise_text().split())
    for rule in ("top_p_filter(logits, top_p) -> Tensor", "same shape",
                 "sum to `top_p` or more", "always kept", "`top_p = 1` keeps every token",
                 "`-inf`", "keep their logits exactly", "1e-4", "no two equal logits",
                 "beam_step(cum_logprobs, logprobs, width)", "best first", "of all beams",
                 "cumulative logprob 0", "first step there is one row"):
        assert rule in text, rule


def test_hints_point_at_the_idea_without_stating_the_code():
    import ast
    import inspect

    code = ["//", " % ", "cumsum", "topk", "torch.", "sort("]
    tree = ast.parse(inspect.getsource(lesson10))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "hint"
                                                for t in node.targets):
            hint = "".join(part.value for part in ast.walk(node.value)
                           if isinstance(part, ast.Constant) and isinstance(part.value, str))
            assert not [c for c in code if c in hint], hint


def test_top_p_one_is_decided_before_any_sum():
    """The spec's one exception to 'rounding never matters': at top_p = 1 a float32 running sum
    reaches 1 before the last tiny probabilities, so the drop rule alone loses tokens."""
    import torch

    from minipaged.exercises import lesson10

    def rule_only(logits, top_p):
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, -1)
        drop = (torch.cumsum(probs, -1) - probs) >= top_p
        drop[0] = False
        out = logits.clone()
        out[order[drop]] = float("-inf")
        return out

    result = lesson10.check_top_p_filter(rule_only)
    assert result.status == "failed" and "top_p=1.0" in result and "decide it first" in result
