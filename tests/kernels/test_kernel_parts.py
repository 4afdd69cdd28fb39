"""csrc/paged_attention.cu and its parts (one kernel family per file): every part is included
once, the CPU builds paste each part in with ``#line`` directives that keep messages pointing at
the real file and line, and no part is a wall."""
import re

import pytest

from minipaged.kernels import cuda_on_cpu
from minipaged.kernels.build import CSRC, CUDA_HEADERS

pytestmark = pytest.mark.lesson05

MAIN = CSRC / "paged_attention.cu"
PARTS = sorted(CSRC.glob("paged_attention_*.cuh"))
INCLUDE = re.compile(r'^#include "(paged_attention_\w+\.cuh)"', re.M)


def test_every_part_is_included_once_and_is_a_build_dependency():
    included = INCLUDE.findall(MAIN.read_text())
    assert sorted(included) == [p.name for p in PARTS] and len(set(included)) == len(included)
    assert all(not INCLUDE.search(p.read_text()) for p in PARTS)  # one level: no part includes one
    assert set(PARTS) <= set(CUDA_HEADERS)  # copied into the build folder, part of its digest


def test_no_file_of_the_kernel_is_a_wall():
    for path in [MAIN, *PARTS]:
        assert len(path.read_text().splitlines()) <= 500, path.name


def test_the_rewrite_pastes_every_part_and_keeps_its_line_numbers():
    text = cuda_on_cpu.rewrite_cuda_source(MAIN.read_text(), str(MAIN))
    assert not INCLUDE.search(text) and "extern __shared__" not in text
    lines = text.split("\n")
    files = {str(MAIN): MAIN.read_text().split("\n"),
             **{str(p): p.read_text().split("\n") for p in PARTS}}
    where, number, checked = None, 0, 0
    for line in lines:  # every line below a #line directive is that file's line of that number
        directive = re.match(r'#line (\d+) "(.*)"$', line)
        if directive:
            number, where = int(directive.group(1)), directive.group(2)
            continue
        original = files[where][number - 1]
        # (a launch and a shared array are rewritten, and so is a comment that holds <<< or >>>)
        if not re.search(r"<<<|>>>|extern __shared__", original):
            assert line == original, (where, number)
            checked += 1
        number += 1
    assert checked > 0.95 * sum(len(v) for v in files.values())


def test_a_dropped_barrier_is_found_in_whichever_part_holds_it():
    text = cuda_on_cpu.rewrite_cuda_source(MAIN.read_text(), str(MAIN),
                                           drop_barrier="every thread's results are out")
    assert "/* barrier dropped */; // every thread's results are out" in text.replace("  //", " //")
