"""The saved component is the checked component (``workbench.save_component``, ``standalone.py``).

A learner's component uses names from other notebook cells: the lesson's imports, helpers they
wrote, constants. The saved file must bind them all, and ``check_component`` loads the copy back
alone and checks it again, so that a copy that would not run is reported in its own lesson (never
first in the capstone). The cells are simulated as IPython runs them: one globals dict for every
cell, each cell's text in ``linecache`` under a file name of its own.
"""
from __future__ import annotations

import itertools
import linecache
import re
import textwrap

import pytest
import torch

from minipaged.exercises import standalone, workbench
from minipaged.exercises.standalone import CannotSave, free_names, standalone_source
from repo_paths import ROOT

_cells = itertools.count()
CELL_MARK = re.compile(r"^# %%.*$", re.M)


def learner_cells(lesson: str) -> list[str]:
    """The cells of ``scripts/learner_answers/lesson<lesson>.py`` (after its docstring)."""
    text = (ROOT / "scripts" / "learner_answers" / f"lesson{lesson}.py").read_text()
    return [part.strip("\n") + "\n" for part in CELL_MARK.split(text)[1:] if part.strip()]


class Notebook:
    """Cells sharing one globals dict, named in ``linecache`` as ipykernel names them."""

    def __init__(self) -> None:
        self.ns: dict = {"__name__": "__main__"}

    def run(self, source: str) -> None:
        source = textwrap.dedent(source)
        filename = f"/tmp/ipykernel_0/{next(_cells)}.py"  # no such file: linecache has the text
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), self.ns)

    def __getitem__(self, name: str):
        return self.ns[name]


@pytest.fixture(autouse=True)
def learner_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path / "learner"))
    return tmp_path / "learner"


def saved_copy(name: str):
    found, missing = workbench.collect([name])
    assert not missing, missing
    return found[name]


# -- lesson 10: a Sampler written with the lesson's helpers -----------------------------------------
LESSON10_IMPORTS = """
import torch

from minipaged.worker.model_runner import Row
from minipaged.worker.sampler import (Sampler, SequenceOutput, apply_penalties, draw,
                                      sequence_generators, top_k_top_p_filter)
"""

# the second answer set's cells (scripts/learner_answers/): a temperature helper, then the class
TEMPERATURE_CELL, SAMPLER_CELL = learner_cells("10")


def test_a_sampler_using_the_lessons_imports_runs_from_its_saved_file():
    """The issue's first failure: the copy lacked apply_penalties and top_k_top_p_filter."""
    notebook = Notebook()
    for cell in (LESSON10_IMPORTS, TEMPERATURE_CELL, SAMPLER_CELL):
        notebook.run(cell)
    result = workbench.check_component("Sampler", notebook["MySampler"], num_cases=40)
    assert result.passed and "its saved copy passes them too" in result, result
    copy = saved_copy("Sampler")
    assert copy is not notebook["MySampler"]
    assert workbench.check_component("Sampler", copy, num_cases=40, save=False).passed
    text = (workbench.learner_dir() / "Sampler.py").read_text()
    assert "from minipaged.worker.sampler import apply_penalties, top_k_top_p_filter" in text
    assert "def temperature_of(params):" in text  # the helper of another cell, as written


# -- lesson 12: rejection_sample calling the learner's residual_distribution ----------------------
LESSON12_IMPORTS = """
import torch

from minipaged.exercises.workbench import check_component
from minipaged.worker.sampler import draw
"""

# the second answer set's cells: two greedy ones (not needed here), a helper with a constant, the
# residual calling it, then rejection_sample calling the residual
*_, FLOOR_CELL, RESIDUAL_CELL, REJECTION_CELL = learner_cells("12")
RESIDUAL_CELLS = [FLOOR_CELL, RESIDUAL_CELL]


def lesson12_notebook(*extra_cells: str) -> Notebook:
    notebook = Notebook()
    for cell in (LESSON12_IMPORTS, *RESIDUAL_CELLS, *extra_cells, REJECTION_CELL):
        notebook.run(cell)
    return notebook


def test_rejection_sample_calling_a_helper_of_another_cell_runs_from_its_saved_file():
    """The issue's second failure: the copy raised NameError at its first rejection."""
    notebook = lesson12_notebook()
    result = workbench.check_component("rejection_sample", notebook["rejection_sample"])
    assert result.passed, result
    text = (workbench.learner_dir() / "rejection_sample.py").read_text()
    # helpers calling helpers, dependencies first, and the constant they read
    assert (text.index("FLOOR = 0.0") < text.index("def positive_part")
            < text.index("def residual_distribution") < text.index("def rejection_sample"))
    copy = saved_copy("rejection_sample")
    assert copy.__globals__["residual_distribution"] is not notebook["residual_distribution"]
    assert workbench.check_component("rejection_sample", copy, save=False).passed


def test_a_helper_named_like_a_lesson_name_is_the_learners_in_the_copy():
    """lesson 12's preamble imports ``draw``; the learner's own ``draw`` must win, as in the
    notebook, so it is written after the preamble."""
    notebook = lesson12_notebook('''
    def draw(probs, generator):
        """my own inverse-CDF draw: one uniform number, as the package's"""
        cdf = torch.cumsum(probs.double(), dim=0)
        u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
        token = int(torch.searchsorted(cdf, u, right=True).clamp(max=len(cdf) - 1))
        while probs[token] <= 0:
            token -= 1
        return token
    ''')
    assert workbench.check_component("rejection_sample", notebook["rejection_sample"]).passed
    copy = saved_copy("rejection_sample")
    mine = copy.__globals__["draw"]
    assert mine.__doc__.startswith("my own") and mine.__code__.co_filename.endswith(
        "rejection_sample.py")


# -- what cannot be saved, and copies that fail ----------------------------------------------------
def test_a_lambda_helper_is_not_a_pass_and_the_message_says_to_use_def(learner_dir):
    notebook = lesson12_notebook("residual_distribution = lambda p, q: "
                                 "torch.clamp(p - q, min=0) / torch.clamp(p - q, min=0).sum()\n")
    result = workbench.check_component("rejection_sample", notebook["rejection_sample"])
    assert result.status == "failed" and "✓" not in result
    assert "passes all" in result and "cannot be saved for the capstone" in result
    assert "`residual_distribution` is a lambda" in result and "def residual_distribution" in result
    assert not (learner_dir / "rejection_sample.py").exists()
    assert workbench.passed("rejection_sample") is None  # not plugged in either


def test_a_value_built_in_a_cell_cannot_be_saved_and_is_named():
    notebook = lesson12_notebook("ONE_HOT_SCALE = torch.tensor(1.0, dtype=torch.float64)\n",
                                 '''
    def residual_distribution(p, q):
        r = torch.clamp(p - q * ONE_HOT_SCALE, min=0)
        return r / r.sum() if r.sum() > 0 else p
    ''')
    result = workbench.check_component("rejection_sample", notebook["rejection_sample"])
    assert result.status == "failed" and "✓" not in result
    assert "your residual_distribution uses `ONE_HOT_SCALE` from another cell" in result
    assert "a Tensor made in a cell" in result


def test_a_copy_that_fails_to_load_is_reported_with_why_and_not_saved(learner_dir):
    notebook = Notebook()
    notebook.run(LESSON10_IMPORTS)
    notebook.run(TEMPERATURE_CELL)
    notebook.run("class Base(Sampler):\n    pass\n")
    notebook.run(SAMPLER_CELL.replace("class MySampler(Sampler):", "class MySampler(Base):"))
    notebook.run("del Base  # gone from the notebook: the class still has it as its base\n")
    result = workbench.check_component("Sampler", notebook["MySampler"], num_cases=10)
    assert result.status == "failed" and "✓" not in result
    assert "your MySampler passes, but its saved copy fails: loading it raises NameError" in result
    assert "name 'Base' is not defined" in result
    assert not (learner_dir / "Sampler.py").exists()  # the capstone will not collect it
    assert (learner_dir / "failed" / "Sampler.py").exists() and "failed/Sampler.py" in result
    assert workbench.passed("Sampler") is None


def test_a_copy_that_fails_its_check_is_reported_with_where(learner_dir):
    notebook = Notebook()
    for cell in (LESSON12_IMPORTS, *RESIDUAL_CELLS):
        notebook.run(cell)
    # the helper found by name at run time: no name in the code says it is needed
    notebook.run(REJECTION_CELL.replace("draw(residual_distribution(p, q), generator)",
                                        'draw(globals()["residual_distribution"](p, q), '
                                        "generator)"))
    result = workbench.check_component("rejection_sample", notebook["rejection_sample"])
    assert result.status == "failed" and "✓" not in result
    assert "passes, but its saved copy fails: KeyError: 'residual_distribution'" in result
    assert "failed/rejection_sample.py\", line 19, in rejection_sample" in result, result
    assert not (learner_dir / "rejection_sample.py").exists()


def test_a_passing_copy_replaces_the_failed_one(learner_dir):
    notebook = lesson12_notebook("residual_distribution = lambda p, q: p\n")
    assert not workbench.check_component("rejection_sample", notebook["rejection_sample"]).passed
    notebook.run(RESIDUAL_CELLS[1])  # the learner writes it with def and runs the cells again
    assert workbench.check_component("rejection_sample", notebook["rejection_sample"]).passed
    assert (learner_dir / "rejection_sample.py").exists()
    assert not (learner_dir / "failed" / "rejection_sample.py").exists()


# -- what a saved file binds ----------------------------------------------------------------------
def test_free_names_follow_pythons_scopes():
    source = textwrap.dedent('''
    @decorate
    class Mine(Base, metaclass=Meta):
        size: Width = DEFAULT

        def method(self, x=SCALE) -> Out:
            local = helper(x) + self.attribute
            squares = [local * k for k in range(3)]
            return torch.stack(squares) + len(squares)

        def other(self):
            def inner():
                return FROM_INNER
            return inner, Mine
    ''')
    assert free_names(source) == sorted(
        ["decorate", "Base", "Meta", "Width", "DEFAULT", "SCALE", "Out", "helper", "range",
         "torch", "len", "FROM_INNER"])


def test_imports_keep_the_learners_names_and_aliases():
    notebook = Notebook()
    notebook.run('''
    import numpy as np
    import torch
    import torch.nn.functional as F
    from minipaged.core.scheduler import Scheduler
    from minipaged.worker.sampler import draw as sample_one
    import math
    TABLE = {"a": (1, 2.5), "b": [None, True, "x"]}
    EMPTY = set()
    package_admit = Scheduler._admit_waiting
    ''')
    notebook.run('''
    def component(x):
        return F.relu(torch.as_tensor(np.asarray(x))), sample_one, math.pi, TABLE, EMPTY, package_admit
    ''')
    text = standalone_source(notebook["component"])
    for line in ("import numpy as np", "import torch.nn.functional as F", "import math",
                 "from minipaged.worker.sampler import draw as sample_one",
                 "TABLE = {'a': (1, 2.5), 'b': [None, True, 'x']}", "EMPTY = set()",
                 "from minipaged.core.scheduler import Scheduler as _Scheduler",
                 "package_admit = _Scheduler._admit_waiting"):
        assert line in text, (line, text)
    namespace: dict = {}
    exec(compile(text, "copy", "exec"), namespace)
    values = namespace["component"]([1.0])
    assert values[1] is notebook["sample_one"] and values[5] is notebook["package_admit"]
    assert values[3] == notebook["TABLE"] and values[4] == set()


def test_a_helper_bound_under_another_name_and_a_learners_base_class():
    notebook = Notebook()
    notebook.run('''
    class Base:
        def twice(self, x):
            return 2 * x


    def triple(x):
        return 3 * x


    times_three = triple
    ''')
    notebook.run('''
    class Mine(Base):
        def go(self, x):
            return times_three(self.twice(x))
    ''')
    text = standalone_source(notebook["Mine"])
    assert text.index("class Base:") < text.index("class Mine(Base):")
    assert "times_three = triple" in text and text.index("def triple") < text.index(
        "times_three = triple")
    namespace: dict = {}
    exec(compile(text, "copy", "exec"), namespace)
    assert namespace["Mine"]().go(2) == 12


def test_functions_made_inside_functions_and_missing_source_cannot_be_saved():
    notebook = Notebook()
    notebook.run('''
    def make_scale(s):
        def scale(x):
            return s * x
        return scale


    halve = make_scale(0.5)


    def component(x):
        return halve(x)
    ''')
    with pytest.raises(CannotSave, match=r"`halve` was made inside another function \(make_scale\)"):
        standalone_source(notebook["component"])
    namespace: dict = {"__name__": "__main__"}
    exec("def no_source(x):\n    return x\n", namespace)  # not in linecache: no source
    with pytest.raises(CannotSave, match="its source cannot be found"):
        standalone_source(namespace["no_source"])
    with pytest.raises(CannotSave, match="lambda"):
        standalone_source(lambda x: x)


def test_two_objects_under_one_name_are_refused():
    first, second = Notebook(), Notebook()
    first.run("def helper():\n    return 1\n\n\ndef helper_user():\n    return helper()\n")
    second.run("def helper():\n    return 2\n")
    second.ns["other"] = first["helper_user"]  # its own code reads the first `helper`
    second.run("def uses_both():\n    return helper(), other()\n")
    with pytest.raises(CannotSave, match="two different objects are named `helper`"):
        standalone_source(second["uses_both"])


def test_a_plain_value_too_large_is_refused_with_its_name():
    notebook = Notebook()
    notebook.run(f"BIG = list(range({standalone.MAX_LITERAL_CHARS}))\n"
                 "def component():\n    return BIG\n")
    with pytest.raises(CannotSave, match="uses `BIG` from another cell: a list too large"):
        standalone_source(notebook["component"])


def test_a_dtype_is_found_through_the_learners_module():
    notebook = Notebook()
    notebook.run("import torch\nWIDE = torch.float64\n"
                 "def component(x):\n    return x.to(WIDE)\n")
    text = standalone_source(notebook["component"])
    assert "WIDE = torch.float64" in text
    namespace: dict = {}
    exec(compile(text, "copy", "exec"), namespace)
    assert namespace["component"](torch.ones(1)).dtype == torch.float64
