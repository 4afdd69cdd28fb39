"""Lesson 05's key-load strips, magnified: a window of one cache line shows vLLM's 4- and 8-byte
lane loads as marks a reader can tell apart, and only the instructions that read in it."""
import xml.etree.ElementTree as ET

import pytest

from visualizer import render_key_loads

NS = "{http://www.w3.org/2000/svg}"


def loads_of(group_size, bytes_per_load, block_size=16, key_bytes=256):
    """Per-lane (offset, bytes) loads of one warp over one block: chunk c of token t at
    c * block_size * 16 + t * 16; a group's lanes split each chunk (vLLM) or take whole ones."""
    lanes = []
    for lane in range(32):
        token, j = lane // group_size, lane % group_size
        loads = []
        for c in range(key_bytes // 16):
            chunk = c * block_size * 16 + token * 16
            if bytes_per_load == 16:
                if c % group_size == j:
                    loads.append((chunk, 16))
            else:
                loads.append((chunk + j * bytes_per_load, bytes_per_load))
        lanes.append(loads)
    return lanes


def test_a_window_magnifies_and_keeps_only_its_instructions():
    loads = {"ours": loads_of(2, 16), "vLLM's": loads_of(2, 8)}
    whole = ET.fromstring(render_key_loads(loads, group_size=2))
    zoomed = ET.fromstring(render_key_loads(loads, group_size=2, window=(0, 128)))

    def widths(root, variant):
        return [float(r.get("width")) for r in root.iter(NS + "rect")
                if r.get("class") == "load" and r.get("data-variant") == variant]

    assert max(widths(whole, "vLLM's")) < 2  # a whole block: 8 bytes are under 2 px
    assert min(widths(zoomed, "vLLM's")) > 40  # one cache line: 8 bytes are 50 px
    instructions = {r.get("data-instruction") for r in zoomed.iter(NS + "rect")
                    if r.get("class") == "load" and r.get("data-variant") == "vLLM's"}
    assert instructions == {"0"}  # the first 128 bytes are chunk 0 of tokens 0-7
    assert "magnified" in "".join(zoomed.itertext())


def test_a_bad_window_names_the_field():
    with pytest.raises(ValueError, match="window"):
        render_key_loads({"ours": loads_of(2, 16)}, group_size=2, window=(64, 64))
