"""The block-table picture's marks that a lesson can tell apart: an event's outline in the legend's
look of its kind (lesson 16: copy-on-write copies, while red marks the newest tokens), where a block not
yet given comes from (a swapped sequence gets it when swapped in), and labels in light sequence
colours that stay readable."""
import xml.etree.ElementTree as ET

import pytest

from minipaged.lab.dry_run import DryRun
from visualizer import render_block_tables
from visualizer.legend import LOOKS
from visualizer.svg import HIGHLIGHT, INK, colour


def _with_class(root, name):
    return [e for e in root.iter() if name in (e.get("class") or "").split()]


def test_an_event_is_drawn_in_the_legend_s_look_of_its_kind():
    run = DryRun(block_size=4, num_gpu_blocks=16)
    run.add_request(list(range(5)))
    run.step()
    # An old caller's colour is not used: the legend decides every mark's colour.
    root = ET.fromstring(render_block_tables(run.block_manager.snapshot(), highlight_blocks=[0],
                                             highlight_colour="#222222", highlight_mark="copy"))
    outline, = _with_class(root, "event-block")
    copied = LOOKS["copied"]
    assert (outline.get("stroke"), outline.get("data-mark")) == (copied.stroke, "copied")
    mark, = _with_class(root, "event-mark")
    assert mark.text == "copied" and mark.get("fill") == copied.stroke
    assert all(s.get("stroke") == HIGHLIGHT for s in _with_class(root, "newest-token"))
    plain = ET.fromstring(render_block_tables(run.block_manager.snapshot(), highlight_blocks=[0]))
    assert _with_class(plain, "event-block")[0].get("stroke") == LOOKS["new"].stroke  # default
    with pytest.raises(ValueError, match="not a mark of the legend"):
        render_block_tables(run.block_manager.snapshot(), highlight_blocks=[0],
                            highlight_mark="moved")


def test_a_swapped_sequence_gets_its_next_block_when_swapped_in():
    snapshot = {"block_size": 4, "gpu_blocks": [], "cpu_blocks": [
        {"block_number": 0, "ref_count": 1, "owners": [7]}],
        "free_gpu_blocks": [], "free_cpu_blocks": [],
        "sequences": [{"seq_id": 7, "request_id": "2", "status": "SWAPPED", "device": "cpu",
                       "num_tokens": 5,
                       "logical_blocks": [{"num_filled": 4}, {"num_filled": 1}],
                       "block_table": [0]}]}
    root = ET.fromstring(render_block_tables(snapshot))
    pending, = _with_class(root, "pending")
    assert pending.text == "1 → (when swapped in)"
    running = dict(snapshot, sequences=[dict(snapshot["sequences"][0], status="RUNNING",
                                             device="gpu")])
    assert _with_class(ET.fromstring(render_block_tables(running)), "pending")[0].text == \
        "1 → (next step)"


def test_a_label_in_a_light_colour_is_drawn_darker_in_its_own_hue():
    run = DryRun(block_size=4, num_gpu_blocks=32)
    for _ in range(6):  # seq 5 is the palette's yellow
        run.add_request(list(range(3)))
    run.step()
    root = ET.fromstring(render_block_tables(run.block_manager.snapshot()))
    labels = {int(g.get("data-seq")): g.find("{*}text") for g in root.iter()
              if g.get("class") == "sequence"}
    assert labels[0].get("fill") == colour(0)  # a dark blue reads well as it is
    yellow, drawn = colour(5), labels[5].get("fill")
    assert drawn != yellow and labels[5].get("stroke") is None  # (no edge round the letters)
    channels = [tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in (yellow, drawn)]
    ratios = [d / y for y, d in zip(*channels)]
    assert max(ratios) - min(ratios) < 0.02 and max(ratios) < 0.8  # the same hue, darker
