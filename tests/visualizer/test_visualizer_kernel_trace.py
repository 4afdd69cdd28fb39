"""Lessons 05 and 06: the drawings of the real kernel's recorded loops show what the text says.

Each drawing gets a record shaped like ``kernel_trace.run_traced``'s (synthetic here, so no build
is needed; the last test draws a real one): every visited block, token, row and load is drawn
with its data attributes, the maximum is marked on the right token, the row totals are the sums
of the warps' row sums, and no label leaves the drawing or covers another.

Slow (left out of `make test`): the last test, which draws a real trace (the traced build of the
kernels); not measured this session.
"""
import random
import xml.etree.ElementTree as ET

import pytest
import torch

from svg_layout import assert_clean_layout
from visualizer import (render_key_loads, render_key_readers, render_logits, render_phase4_sums,
                        render_warp_visits)

pytestmark = pytest.mark.lesson06
NS = "{http://www.w3.org/2000/svg}"


def groups(svg, cls):
    return [g for g in ET.fromstring(svg).iter(NS + "g") if g.get("class") == cls]


def block_trace(tokens, block_size, head_size=64, first_token=0, seed=0):
    rng = random.Random(seed)
    blocks = -(-tokens // block_size)
    first_block = first_token // block_size
    visits = [[first_block + b for b in range(w, blocks, 4)] for w in range(4)]
    return {"visits": visits,
            "physical": [[rng.randrange(2000) for _ in v] for v in visits],
            "logits": torch.randn(tokens, generator=torch.Generator().manual_seed(seed)) * 3,
            "first_token": first_token, "max": 0.0, "exp_sum": 1.0,
            "warp_sums": torch.randn(4, head_size) / 10,
            "lane_sums": torch.zeros(4, head_size, 2)}


@pytest.mark.parametrize("tokens,block_size", [(150, 16), (37, 16), (1, 8), (512, 32), (16, 16)])
def test_visit_grid_draws_every_visit_of_every_warp(tokens, block_size):
    t = block_trace(tokens, block_size)
    svg = render_warp_visits(t, title="phase 2: the KV blocks of sequence 1 each warp visits")
    assert_clean_layout(svg, "warp visits")
    drawn = {(int(g.get("data-warp")), int(g.get("data-block"))): g for g in groups(svg, "visit")}
    expected = {(w, b) for w in range(4) for b in t["visits"][w]}
    assert set(drawn) == expected
    assert sorted(b for _, b in drawn) == list(range(-(-tokens // block_size)))
    for w in range(4):
        for order, (b, p) in enumerate(zip(t["visits"][w], t["physical"][w]), start=1):
            g = drawn[(w, b)]
            assert g.get("data-physical") == str(p) and g.get("data-order") == str(order)
            assert f"p{p}" in "".join(g.itertext())
    labels = "".join(ET.fromstring(svg).itertext())
    assert all(f"warp {w}" in labels for w in range(4))


@pytest.mark.parametrize("tokens,block_size,first", [(150, 16, 0), (1, 8, 0), (76, 16, 1024),
                                                     (512, 32, 512)])
def test_logits_row_draws_every_token_and_marks_the_maximum(tokens, block_size, first):
    t = block_trace(tokens, block_size, first_token=first)
    svg = render_logits(t, block_size, title="phase 2: the logits of sequence 1, head 0")
    assert_clean_layout(svg, "logits")
    bars = groups(svg, "logit")
    assert [int(g.get("data-token")) for g in bars] == list(range(first, first + tokens))
    for g in bars:  # the colour names the warp that computed the token
        token = int(g.get("data-token"))
        assert int(g.get("data-warp")) == (token - first) // block_size % 4
    [marker] = groups(svg, "max-marker")
    best = int(torch.argmax(t["logits"]))
    assert int(marker.get("data-token")) == first + best
    assert f"at token {first + best}" in "".join(marker.itertext())


def test_phase4_table_adds_the_warps_rows_into_the_output():
    t = block_trace(150, 16)
    out_row = t["warp_sums"].sum(0)
    svg = render_phase4_sums(t, out_row, rows=range(8),
                             title="phase 4: each warp's row sums, added into the output")
    assert_clean_layout(svg, "phase 4 sums")
    cells = groups(svg, "warp-sum")
    assert {(int(g.get("data-row")), int(g.get("data-warp"))) for g in cells} == \
        {(r, w) for r in range(8) for w in range(4)}
    totals = {int(g.get("data-row")): float(g.get("data-value")) for g in groups(svg, "row-total")}
    outputs = {int(g.get("data-row")): float(g.get("data-value")) for g in groups(svg, "output")}
    for row in range(8):
        assert totals[row] == pytest.approx(float(t["warp_sums"][:, row].sum()), rel=2e-3, abs=1e-6)
        assert outputs[row] == pytest.approx(totals[row], rel=2e-3, abs=1e-6)


def loads_of(group, bytes_per_load, chunks, block_size=16):
    """Per-lane (offset, bytes) like the kernel's: ours (whole chunks) or vLLM's (shared)."""
    lanes = []
    for lane in range(32):
        token, j = divmod(lane, group)
        if bytes_per_load == 16:
            lanes.append([((c * block_size + token) * 16, 16) for c in range(j, chunks, group)])
        else:
            lanes.append([((c * block_size + token) * 16 + j * bytes_per_load, bytes_per_load)
                          for c in range(chunks)])
    return lanes


def test_key_loads_draw_every_lane_load_of_both_variants():
    loads = {"ours (G = 2)": loads_of(2, 16, 16), "vLLM's (G = 2)": loads_of(2, 8, 16)}
    svg = render_key_loads(loads, group_size=2,
                           title="phase 2, warp 0: the key bytes each load instruction reads")
    assert_clean_layout(svg, "key loads")
    rects = [r for r in ET.fromstring(svg).iter(NS + "rect") if r.get("class") == "load"]
    for name, lanes in loads.items():
        mine = [r for r in rects if r.get("data-variant") == name]
        assert len(mine) == sum(len(v) for v in lanes)
        assert len({r.get("data-instruction") for r in mine}) == max(len(v) for v in lanes)
        assert sum(int(r.get("data-bytes")) for r in mine) == 4096
    labels = "".join(ET.fromstring(svg).itertext())
    assert "8 load instructions of 16 B" in labels and "16 load instructions of 8 B" in labels


def test_key_readers_draw_one_stripe_per_cuda_block_that_loaded_a_key():
    """Lesson 18: 9 query heads on 3 kv heads; V1's CUDA blocks are query heads, 3 per key, the
    grouped kernel's are kv heads, 1 per key."""
    tokens = 20
    readers = {"V1": {(kv, t): [3 * kv, 3 * kv + 1, 3 * kv + 2] for kv in range(3)
                      for t in range(tokens)},
               "version 3": {(kv, t): [kv] for kv in range(3) for t in range(tokens)}}
    svg = render_key_readers(readers, 3, tokens, title="who loads which key")
    assert_clean_layout(svg, "key readers")
    rects = [r for r in ET.fromstring(svg).iter(NS + "rect") if r.get("class") == "reader"]
    for name, who in readers.items():
        drawn = {}
        for r in rects:
            if r.get("data-kernel") == name:
                key = (int(r.get("data-kv-head")), int(r.get("data-token")))
                drawn.setdefault(key, []).append(int(r.get("data-cuda-block")))
        assert drawn == who
    labels = "".join(ET.fromstring(svg).itertext())
    assert "each key loaded by 3 CUDA blocks" in labels and "loaded by 1 CUDA block" in labels


def test_bad_input_is_refused():
    empty = {"visits": [[], [], [], []], "physical": [[], [], [], []], "logits": []}
    with pytest.raises(ValueError):
        render_warp_visits(empty)
    with pytest.raises(ValueError):
        render_logits(empty, 16)
    with pytest.raises(ValueError):
        render_key_loads({}, 2)


@pytest.mark.slow
def test_a_real_trace_is_drawn_as_recorded():
    from minipaged.lab import kernel_trace
    from kernel_inputs import make_inputs

    inputs = make_inputs(64, 16, lens=(150,), num_heads=1, num_kv_heads=1)
    out, trace = kernel_trace.run_traced(*inputs)
    t = trace[(0, 0, 0)]
    svg = render_warp_visits(t)
    assert {(int(g.get("data-warp")), int(g.get("data-block"))) for g in groups(svg, "visit")} \
        == {(w, b) for w in range(4) for b in t["visits"][w]}
    svg = render_logits(t, 16)
    [marker] = groups(svg, "max-marker")
    assert float(marker.get("data-value")) == pytest.approx(t["max"], rel=1e-3)
    svg = render_phase4_sums(t, out[0, 0])
    for g in groups(svg, "output"):
        assert float(g.get("data-value")) == pytest.approx(float(out[0, 0, int(g.get("data-row"))]),
                                                           rel=2e-3, abs=1e-6)
