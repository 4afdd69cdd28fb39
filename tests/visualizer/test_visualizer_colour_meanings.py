"""One colour per meaning: sequences never get the colour of an event (red) or of a free block
(grey), and a scheduler badge wears the colours of its sequences' block tables."""
import colorsys
import xml.etree.ElementTree as ET

from minipaged.lab.dry_run import DryRun
from visualizer import render_block_tables, render_scheduler
from visualizer.block_tables import label_colour
from visualizer.svg import HIGHLIGHT, PALETTE, colour


def _hsv(hex_colour):
    r, g, b = (int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return colorsys.rgb_to_hsv(r, g, b)


def test_no_sequence_colour_is_red_or_grey():
    for c in PALETTE:
        hue, saturation, _ = _hsv(c)
        assert saturation > 0.2, f"{c} is grey: it reads as a free or evictable block"
        degrees = hue * 360
        assert 15 < degrees < 330, f"{c} is red or pink: it reads as {HIGHLIGHT}'s events"


def test_a_badge_is_striped_in_its_sequences_table_colours():
    run = DryRun(block_size=4, num_gpu_blocks=16)
    run.add_request(list(range(6)))  # seq 0
    group = run.add_request(list(range(5)), n=3)  # seqs 1, 2, 3: seq 3 was red before
    run.step()
    root = ET.fromstring(render_scheduler(run.scheduler.snapshot()))
    badge = next(b for b in root.iter() if b.get("class") == "badge"
                 and b.get("data-request") == group.request_id)
    stripes = [(int(r.get("data-seq")), r.get("fill")) for r in badge.iter()
               if r.get("class") == "badge-fill"]
    assert stripes == [(s.seq_id, colour(s.seq_id)) for s in group.get_seqs()]

    tables = ET.fromstring(render_block_tables(run.block_manager.snapshot()))
    for seq in group.get_seqs():
        label = next(g for g in tables.iter() if g.get("class") == "sequence"
                     and g.get("data-seq") == str(seq.seq_id)).find("{*}text")
        # (the same colour, darkened where too light to read as text: label_colour)
        assert label.get("fill") == label_colour(dict(stripes)[seq.seq_id])
