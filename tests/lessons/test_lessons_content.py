"""What a lesson's cells print and draw says what its text says (cells run on their own here,
without a kernel: only cells that need no model)."""
import json
import math
import xml.etree.ElementTree as ET

import pytest

from lesson_cells import run_cell
from repo_paths import ROOT


@pytest.mark.lesson02
def test_lesson_02_block_table_entries_are_the_ceiling():
    """A request of 300 tokens needs 2 entries with blocks of 256, not round(1.2) = 1."""
    from IPython.display import Markdown

    from minipaged.lab import kv_memory

    ns = {"kv_memory": kv_memory, "Markdown": Markdown}
    [table] = run_cell("02_blocks", "block-table entries for an average request", ns)
    rows = [line.split("|")[1:-1] for line in table.data.splitlines()[2:]]
    for block_size, _, entries in rows:
        assert int(entries) == math.ceil(ns["mean_len"] / int(block_size)), (block_size, entries)
    assert ns["mean_len"] > 256  # so the last row really needs the ceiling


@pytest.mark.lesson09
def test_lesson_09_titles_fit_the_drawings():
    """The chunked-prefill pictures carry long titles: each lies inside its drawing, and the
    drawing fits a JupyterLab output area."""
    import torch
    from IPython.display import SVG

    from minipaged import SamplingParams
    from minipaged.core.block_manager import BlockSpaceManager
    from minipaged.core.scheduler import Scheduler, SchedulerConfig
    from minipaged.exercises.workbench import plugged_in
    from minipaged.lab.dry_run import apply_step
    from minipaged.sequence import Sequence, SequenceGroup
    from minipaged.worker.model_runner import prepare_inputs
    from visualizer.flat_batch import render_flat_batch

    ns = dict(BlockSpaceManager=BlockSpaceManager, Scheduler=Scheduler,
              SchedulerConfig=SchedulerConfig, SequenceGroup=SequenceGroup, Sequence=Sequence,
              SamplingParams=SamplingParams, apply_step=apply_step, prepare_inputs=prepare_inputs,
              torch=torch, render_flat_batch=render_flat_batch, SVG=SVG, plugged_in=plugged_in,
              names={0: "a", 1: "b", 2: "c"})
    shown = run_cell("09_continuous_batching", "budget 4, step", ns)
    assert len(shown) == 3
    for svg in shown:
        root = ET.fromstring(svg.data)
        title = next(t for t in root.iter() if t.get("class") == "caption")
        assert 10 + 0.6 * 13 * len(title.text) <= float(root.get("width")) <= 800, title.text


@pytest.mark.parametrize("path", sorted((ROOT / "lessons").glob("*.ipynb")), ids=lambda p: p.stem)
def test_each_lesson_says_what_vllm_did_then_does_now_and_minipaged_does_here(path):
    cells = json.loads(path.read_text())["cells"]
    box = next(("".join(c["source"]) for c in cells
                if "".join(c["source"]).startswith("## vLLM then, now, and here")), None)
    assert box is not None, "no 'vLLM then, now, and here' box"
    assert all(f"**{part}.**" in box for part in ("Then", "Now", "Here"))
    assert "v0.1" in box and ("V1" in box or "today" in box)  # versions named
