"""Lesson 05: a built library is used only if it can raise (minipaged/kernels/library_check.py).

The failure this guards against was seen on a GPU machine: the CUDA extension had been linked
with a private copy of libstdc++, and every error message that formats a number crashed the
process. The slow test reproduces it here with a tiny torch extension linked the same way
(``-static-libstdc++``): the library defines its own stream code and the number vanishes from
the message; the check refuses it, and the link line of ``kernels/build.py`` prevents it.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minipaged.kernels import library_check
from minipaged.kernels.build import SHARED_CXX_RUNTIME

pytestmark = pytest.mark.lesson05


def fake_library(tmp_path, body: str):
    """A Python file standing in for an extension: the probe loads it the same way."""
    path = tmp_path / "fake_op.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_a_probe_that_raises_with_its_number_passes(tmp_path):
    lib = fake_library(tmp_path, """
        def check(n):
            raise RuntimeError(f"n must be below 4, got {n}")
    """)
    assert library_check.probe(lib, "fake_op", "m.check(7)", r"got 7$") is None


def test_a_probe_that_crashes_is_reported_with_its_signal(tmp_path):
    lib = fake_library(tmp_path, """
        import os, signal
        def check(n):
            os.kill(os.getpid(), signal.SIGSEGV)
    """)
    problem = library_check.probe(lib, "fake_op", "m.check(7)", r"got 7$")
    assert problem is not None and "died with SIGSEGV" in problem


def test_a_message_that_lost_its_number_is_reported(tmp_path):
    lib = fake_library(tmp_path, """
        def check(n):
            raise RuntimeError("n must be below ")  # what a broken stream leaves
    """)
    problem = library_check.probe(lib, "fake_op", "m.check(7)", r"below 4, got 7$")
    assert problem is not None and "garbled" in problem


def test_a_probe_that_returns_is_reported(tmp_path):
    lib = fake_library(tmp_path, "def check(n):\n    return n\n")
    problem = library_check.probe(lib, "fake_op", "m.check(7)", r"got 7$")
    assert problem is not None and "did not raise" in problem


@pytest.mark.slow  # (5 s)
def test_the_verdict_is_kept_until_the_library_changes(tmp_path, monkeypatch):
    lib = fake_library(tmp_path, "def check(n):\n    raise RuntimeError(f'got {n}')\n")
    calls = []
    monkeypatch.setattr(library_check, "own_stream_symbols", lambda path: calls.append(1) or [])
    assert library_check.verify(lib, "fake_op", "m.check(7)", r"got 7$") is None
    assert library_check.verify(lib, "fake_op", "m.check(7)", r"got 7$") is None
    assert len(calls) == 1, "a verified library is not checked again"
    lib.write_text("def check(n):\n    return n\n")
    assert "did not raise" in library_check.verify(lib, "fake_op", "m.check(7)", r"got 7$")


TINY_OP = """
#include <torch/extension.h>
int64_t check(int64_t n) {
  TORCH_CHECK(n < 4, "value must be below ", 4, ", got ", n);
  return n;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("check", &check); }
"""


@pytest.mark.slow
def test_a_private_libstdcxx_is_caught_and_our_link_line_prevents_it(tmp_path):
    """slow: two compiles of a tiny torch extension, ~60-90 s on the 2-core machine."""
    (tmp_path / "op.cpp").write_text(TINY_OP)
    verdicts = {}
    for variant, ldflags in {"private": ["-static-libstdc++"],
                             "ours": ["-static-libstdc++", SHARED_CXX_RUNTIME]}.items():
        script = textwrap.dedent(f"""
            from torch.utils import cpp_extension
            from minipaged.kernels import build
            build.make_ninja_findable()
            m = cpp_extension.load(name="tiny_{variant}", sources=[{str(tmp_path / 'op.cpp')!r}],
                                   build_directory={str(tmp_path)!r} + "/{variant}",
                                   extra_ldflags={ldflags!r})
            print(m.__file__)
        """)
        (tmp_path / variant).mkdir()
        built = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                               timeout=600)
        assert built.returncode == 0, built.stderr[-2000:]
        library = built.stdout.strip().splitlines()[-1]
        symbols = library_check.own_stream_symbols(library)
        problem = library_check.verify(Path(library), f"tiny_{variant}", "m.check(7)",
                                       r"below 4, got 7$")
        verdicts[variant] = (len(symbols or []), problem)
        print(variant, verdicts[variant])
    count, problem = verdicts["private"]
    assert count > 100 and "symbols of libstdc++'s stream code itself" in problem
    assert verdicts["ours"] == (0, None)

