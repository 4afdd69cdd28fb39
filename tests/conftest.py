"""Shared by every test: the helper modules of tests/helpers/ importable by name (``from
tiny_models import ...``) from any folder of tests/, and the tiny models as session fixtures."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))

from budgets import load_profile  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

load_profile()


@pytest.fixture(autouse=True)
def _exercises_unanswered_by_default(monkeypatch):
    """No test here sees MINIPAGED_SOLUTIONS unless it sets it: lessons/conftest.py sets it for
    the notebooks, and a run of ``pytest tests lessons`` imports that into this process too."""
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)


@pytest.fixture(autouse=True)
def _no_cost_checks_by_default(monkeypatch):
    """A passing build-track check also times the component against the package's
    (exercises/cost.py, a second or more each); tests of the checkers turn that off, and
    tests/exercises/test_cost_checks.py turns it on again."""
    monkeypatch.setenv("MINIPAGED_COST_CHECKS", "0")


@pytest.fixture(scope="session")
def cpu_op():
    """The C++ CPU op (built once per machine, then loaded), or the test skipped where it
    cannot be built."""
    from minipaged.kernels import build

    op = build.CPU_OP.load()
    if op is None:
        pytest.skip("the C++ CPU op could not be built here (see the warning)")
    return op


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(directory, transformers model) of a tiny random LLaMA with 4 heads and 2 kv heads."""
    path = tmp_path_factory.mktemp("tiny_llama")
    return str(path), save_tiny_model("llama", path)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gpt2")
    return str(path), save_tiny_model("gpt2", path)


@pytest.fixture(scope="session", params=["gpt2", "llama"])
def tiny_model(request, tiny_llama, tiny_gpt2):
    """Both architectures: (kind, directory, transformers model)."""
    path, model = tiny_llama if request.param == "llama" else tiny_gpt2
    return request.param, path, model
