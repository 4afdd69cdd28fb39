"""Lesson 05: every compiled back-end refuses malformed input with a Python exception.

slow: builds or loads the C++ CPU op and the CUDA kernels built for the CPU, then runs the table
of ``minipaged/kernels/malformed.py`` in child processes (~30-60 s once built; a first build of
the CUDA-on-CPU kernels takes minutes). A crash fails its case, not the test run.
"""
import pytest

from minipaged.kernels import malformed

pytestmark = [pytest.mark.lesson05, pytest.mark.slow]


@pytest.mark.parametrize("backend", ["cpu_op", "cuda_on_cpu"])
def test_each_malformed_input_raises_naming_the_argument(backend):
    rows = malformed.run_table(backend)
    assert rows is not None, f"{backend} is not available on this machine"
    print(malformed.format_table(backend, rows))
    failed = [row for row in rows if not row["ok"]]
    assert not failed, malformed.format_table(backend, failed)
    assert len(rows) == len(malformed.CASES)
