"""Worker processes import exactly what the driver imports (``minipaged/child_process.py``).

A worker that had the ``minipaged/`` folder itself on its path saw ``kernels``, ``models``,
``core``, ... as top-level modules: transformers 5.25 imports Hugging Face's ``kernels`` package
and got ours, and every tensor-parallel engine failed while loading. These run in the fast tier,
so that ``make test`` on a fresh clone starts real workers once.
"""
import json
import subprocess
import sys

from minipaged.child_process import python_argv
from tp_helpers import (assert_same_outputs, fake_top_level_modules, inside_the_package,
                        one_rank_and_n_ranks, where_names_resolve)

PROBE = ("import json; sys.path.insert(0, sys.argv[1]); from tp_helpers import "
         "where_names_resolve; print(json.dumps(where_names_resolve()))")


def _child_sees() -> dict:
    helpers = [p for p in sys.path if p.endswith("helpers")][0]
    child = subprocess.run(python_argv(PROBE, helpers), capture_output=True, text=True,
                           timeout=120, check=True)
    return json.loads(child.stdout.splitlines()[-1])


def test_a_child_has_this_process_s_path_and_no_folder_of_the_package():
    seen = _child_sees()
    helpers = [p for p in sys.path if p.endswith("helpers")][0]
    assert seen["sys_path"] == [helpers] + sys.path
    assert inside_the_package(seen) == []
    assert inside_the_package(where_names_resolve()) == []  # nor does this process


def test_a_child_hands_its_arguments_on_as_python_c_does():
    child = subprocess.run(python_argv("print(sys.argv[1:])", "a b", 3), capture_output=True,
                           text=True, timeout=60, check=True)
    assert child.stdout.strip() == "['a b', '3']"


def test_two_ranks_with_fake_top_level_modules_on_the_path_match_one_rank(
        tiny_llama, tmp_path, monkeypatch):
    path, model = tiny_llama
    monkeypatch.setattr(sys, "path", sys.path + [str(fake_top_level_modules(tmp_path))])
    reference, outputs, stats = one_rank_and_n_ranks(path, model, 2)
    assert_same_outputs(reference, outputs)
    assert stats.num_preemptions_swap > 0  # the workers swapped blocks too
