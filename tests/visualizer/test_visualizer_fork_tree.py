"""Lesson 03's fork trees, drawn by us: the whole tree inside the drawing (a wide beam tree is
scaled to the output, never cut), and a legend of only the kinds of node the tree has, smaller
than the tree."""
import xml.etree.ElementTree as ET

import pytest

from minipaged import LLM, SamplingParams
from svg_layout import NS, assert_clean_layout
from visualizer import EventRecorder, fork_tree_nodes
from visualizer.fork_tree import legend_kinds
from visualizer.fork_tree_svg import MAX_WIDTH, node_lines, render_fork_tree_svg


def _tree(tiny_llama, params):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, num_gpu_blocks=64, max_model_len=128)
    recorder = EventRecorder.for_engine(llm.llm_engine)
    llm.generate(prompt_token_ids=[[3, 4, 5, 6, 7, 8]], sampling_params=params, use_tqdm=False)
    return fork_tree_nodes(recorder, "0")


def _groups(root, cls):
    return [g for g in root.iter(NS + "g") if g.get("class") == cls]


@pytest.mark.lesson03
@pytest.mark.parametrize("kind", ["sampling", "beam"])
def test_the_fork_tree_fits_and_its_legend_lists_what_it_has(tiny_llama, kind):
    params = (SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True)
              if kind == "sampling" else
              SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=12,
                             ignore_eos=True))
    nodes = _tree(tiny_llama, params)
    svg = render_fork_tree_svg(nodes)
    assert_clean_layout(svg, f"{kind} fork tree")  # every label inside, none over another
    root = ET.fromstring(svg)
    view_w, view_h = (float(v) for v in root.get("viewBox").split()[2:])
    assert float(root.get("width")) <= MAX_WIDTH
    for node in _groups(root, "fork-node"):
        box = node.find(NS + "rect")
        assert float(box.get("x")) + float(box.get("width")) <= view_w
        assert float(box.get("y")) + float(box.get("height")) <= view_h
    assert len(_groups(root, "fork-node")) == len(nodes)
    assert len([e for e in root.iter(NS + "path") if e.get("class") == "fork-edge"]) == \
        len(nodes) - 1
    drawn = {g.get("data-kind") for g in _groups(root, "legend-entry")}
    assert drawn == legend_kinds(nodes)
    if kind == "sampling":
        assert drawn == {"root", "final"}  # every sample finished: none dropped, no name reused
    else:
        assert {"dropped", "name"} <= drawn
    tree_h, tree_w = float(root.get("data-tree-height")), float(root.get("data-tree-width"))
    legend_h = view_h - tree_h
    assert legend_h < tree_h, (legend_h, tree_h)  # the legend is smaller than the tree
    if kind == "beam":
        assert view_w == tree_w  # the legend wraps within the tree's width


def test_node_lines_are_short():
    from visualizer.fork_tree import ForkNode
    root = ForkNode(0, None, "request 0: prompt of 5 tokens, blocks [0, 1]", None)
    child = ForkNode(1, 4, "seq 4b (from seq 2 at step 5, 12 tokens)", 0)
    assert node_lines(root) == ["request 0", "prompt of 5 tokens", "blocks [0, 1]"]
    assert node_lines(child) == ["seq 4b", "from seq 2", "step 5 · 12 tokens"]
    with pytest.raises(ValueError, match="not in the recording"):
        render_fork_tree_svg([])
