"""Lessons 05 and 06: what the kernel lessons' text claims is what the package computes.

Lesson 05's section on the addresses one warp reads once printed 16 sectors for both key layouts
at block size 16 while its text implied a 4x cost; the text now says which count is about bytes.
"""
import json

import pytest

from minipaged.lab import emulator as emu
from repo_paths import ROOT



def markdown(lesson: str) -> str:
    cells = json.loads((ROOT / "lessons" / f"{lesson}.ipynb").read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


@pytest.mark.lesson05
def test_sector_and_line_counts_are_the_ones_the_text_states():
    text = markdown("05_kernel")
    counts = {}
    for block_size in (8, 16, 32):
        shape = emu.KernelShape(head_size=128, block_size=block_size, x=8)
        counts[block_size] = {layout: emu.warp_key_load(shape, 2, layout)
                              for layout in ("paged", "naive")}
    for block_size in (8, 16):  # the same bytes either way
        assert counts[block_size]["paged"]["sectors"] == 16
        assert counts[block_size]["naive"]["sectors"] == 16
    assert counts[32]["naive"]["sectors"] == 32 and counts[32]["paged"]["sectors"] == 16
    assert counts[16]["paged"]["lines"] == 4 and counts[16]["naive"]["lines"] == 16
    assert "both layouts move the same 16 sectors" in text
    assert "4 against 16" in text and "not a 4x cost in bandwidth" in text
    assert "4 times as many" not in text


@pytest.mark.lesson05
def test_lesson_05_names_vllms_vec_size_and_the_switch():
    text = markdown("05_kernel")
    assert "VEC_SIZE = 16 / (G * sizeof(T))" in text
    assert "MINIPAGED_SHARED_GROUP_LOAD" in text
    assert "say nothing about a GPU" in text  # the CPU timings are not GPU timings


@pytest.mark.lesson06
def test_lesson_06_draws_each_recorded_loop():
    cells = json.loads((ROOT / "lessons" / "06_kernel_phases.ipynb").read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    for renderer in ("render_warp_visits", "render_logits", "render_phase4_sums",
                     "render_butterfly"):
        assert f"{renderer}(" in code
    assert "kernel_trace.run_traced(" in code and "reference_logits(" in code
