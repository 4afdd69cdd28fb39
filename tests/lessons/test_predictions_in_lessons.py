"""Predict, then measure (exercises/predictions.py) in the lessons: at least eight lessons ask for a
number before the cell that measures it, and compare the guess with what that cell measured.

The scan is static. In a lesson that predicts, a markdown cell asks the question, the next code
cell is ``my_prediction = None  # <- your guess: ...``, and a later cell calls
``compare("NN", ..., my_prediction, <measured>, ...)`` with the lesson's own number. The measured
value must come from a variable the lesson computes after the guess (never a constant, never a
number the learner could read off before guessing), and nothing in between may overwrite the
guess.
"""
from __future__ import annotations

import ast
import json
import re

import pytest

from repo_paths import ROOT

LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))
GUESS = re.compile(r"^my_prediction = None  # <- your guess: \S.*$", re.M)
IMPORT = "from minipaged.exercises.predictions import compare"


def _cells(path):
    return json.loads(path.read_text())["cells"]


def _source(cell) -> str:
    return "".join(cell["source"])


def _tree(cell):
    try:
        return ast.parse(_source(cell))
    except SyntaxError:  # (an IPython magic: such a cell assigns nothing the scan follows)
        return ast.Module(body=[], type_ignores=[])


def _assigned(tree) -> set[str]:
    """Names a cell binds at its top level or in its loops (not inside functions)."""
    names = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For)):
            targets = [node.target]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        for target in targets:
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _loaded(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _compare_calls(tree, lesson: str):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "compare"):
            yield node


def _measured_names(tree, call) -> set[str]:
    """The names the measured argument reads, following the cell's own assignments back."""
    names = _loaded(call.args[3])
    values = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        values.setdefault(n.id, set()).update(_loaded(node.value))
    todo = list(names)
    while todo:
        for name in values.get(todo.pop(), ()):
            if name not in names:
                names.add(name)
                todo.append(name)
    return names


def predictions_of(path):
    """[(guess cell, compare cell, compare call)] of one lesson, in order."""
    cells = _cells(path)
    lesson = path.name[:2]
    found = []
    guesses = [i for i, c in enumerate(cells) if c["cell_type"] == "code" and GUESS.search(_source(c))]
    for g in guesses:
        later = [(i, call) for i in range(g + 1, len(cells)) if cells[i]["cell_type"] == "code"
                 for call in _compare_calls(_tree(cells[i]), lesson)]
        assert later, f"{path.name}: cell {g} asks for a prediction that no later cell compares"
        found.append((g, *later[0]))
    return found


# The line of each lesson's measuring cell: the guess must come before it (and the comparison at or
# after it). A guess placed between a measurement and the cell that reads it off would pass the
# generic scan above, so the measurements are named here.
MEASURING = {
    "01": "contiguous = kv_memory.contiguous_waste(trace, capacity)",
    "02": "report = kv_memory.paged_waste(trace, capacity=16384, block_size=block_size)",
    "03": "shared_peak, shared_texts = peak_blocks(llm, ",
    "04": 'engine = make_engine("swap")',
    "08": 'engine.add_request("france", "The capital of France is", greedy)',
    "09": "last = [(b, steps_fn(b, 8, [256] * 4)[-1]) for b in budgets]",
    "10": "after_p = top_k_top_p_filter(logits, -1, top_p)",
    "11": 'engine.add_request("u2", prompts[1], params)',
    "12": "runs[name] = dict(tokens=out.outputs[0].token_ids, text=out.outputs[0].text,",
    "15": "rows = roofline.decode_sweep(llm, batch_sizes, prompt_len=4, num_steps=3)",
    "18": "engines[kind] = LLM(kv_cache_bytes=BUDGET, max_model_len=256, num_cpu_blocks=0,",
    "20": "tokens, held, shots = run_and_watch(mistral, PROMPT, NEW, picture_at=40)",
}


@pytest.mark.parametrize("lesson", sorted(MEASURING))
def test_the_guess_comes_before_the_cell_that_measures(lesson):
    [path] = [p for p in LESSONS if p.name.startswith(lesson + "_")]
    cells = _cells(path)
    measuring = [i for i, c in enumerate(cells) if c["cell_type"] == "code"
                 and MEASURING[lesson] in _source(c)]
    assert len(measuring) == 1, f"{path.name}: the measuring cell ({MEASURING[lesson]!r})"
    [(guess, where, _)] = predictions_of(path)
    assert guess < measuring[0] <= where, \
        (f"{path.name}: the guess (cell {guess}) must come before the measurement (cell "
         f"{measuring[0]}), the comparison (cell {where}) at or after it")


def test_at_least_eight_lessons_ask_for_a_prediction():
    predicting = [p.name for p in LESSONS if predictions_of(p)]
    assert len(predicting) >= 8, predicting


@pytest.mark.parametrize("path", [p for p in LESSONS if predictions_of(p)], ids=lambda p: p.name)
def test_each_prediction_is_asked_first_and_compared_with_what_the_lesson_measured(path):
    cells = _cells(path)
    lesson = path.name[:2]
    trees = [_tree(c) if c["cell_type"] == "code" else None for c in cells]
    imported = next((i for i, c in enumerate(cells) if IMPORT in _source(c)), None)
    for guess, where, call in predictions_of(path):
        # the question: a markdown cell right before the guess, asking for a number
        question = cells[guess - 1]
        assert question["cell_type"] == "markdown" and "?" in _source(question), \
            f"{path.name}: cell {guess - 1} must ask the question the guess answers"
        assert imported is not None and imported < guess, f"{path.name}: {IMPORT} first"
        # compare("NN", "question", my_prediction, measured, unit=..., why=...)
        assert len(call.args) >= 4 and isinstance(call.args[0], ast.Constant) \
            and call.args[0].value == lesson, f"{path.name}: compare({lesson!r}, ...)"
        assert isinstance(call.args[2], ast.Name) and call.args[2].id == "my_prediction"
        keywords = {k.arg for k in call.keywords}
        assert {"unit", "why"} <= keywords, f"{path.name}: say the unit and why it is what it is"
        measured = call.args[3]
        assert not isinstance(measured, ast.Constant), f"{path.name}: compare with a measurement"
        # the measurement is computed after the guess, not before it
        names = _measured_names(trees[where], call)
        first = {}
        for i, tree in enumerate(trees):
            for name in _assigned(tree) if tree is not None else ():
                first.setdefault(name, i)
        assert any(guess < first.get(name, -1) <= where for name in names), \
            (f"{path.name}: compare in cell {where} reads {sorted(names)}, all of them computed "
             f"before the guess in cell {guess}: ask before the cell that measures")
        # and nothing overwrites the learner's guess before the comparison
        for i in range(guess + 1, where + 1):
            assert trees[i] is None or "my_prediction" not in _assigned(trees[i]), \
                f"{path.name}: cell {i} overwrites my_prediction"
