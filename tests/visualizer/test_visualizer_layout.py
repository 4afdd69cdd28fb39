"""Every SVG view keeps its text inside the drawing and never writes one label over another.

Each renderer draws random states (random pools, tables, queues, series); every <text> gets a
box from its font size and length (monospace: 0.6 em per character, 1 em high) and its anchor.
No box may leave the viewBox, and no two boxes may overlap.
"""
import random
import xml.etree.ElementTree as ET

import pytest

from minipaged.lab import emulator as emu
from minipaged.lab import kv_memory
from minipaged.lab.dry_run import RandomTraffic
from svg_layout import NS, assert_clean_layout
from visualizer.legend import LOOKS
from visualizer import (butterfly_steps, render_block_tables, render_butterfly,
                        render_line_chart, render_memory_waste, render_scheduler)


def random_runs(seed: int, steps: int):
    """Scheduler/block-manager states of random traffic, with pools of up to ~1500 blocks."""
    rng = random.Random(seed)
    traffic = RandomTraffic(rng, rng.choice([1, 4, 16]), rng.choice([6, 12, 40, 1456]),
                            preemption_mode=rng.choice(["swap", "recompute"]))
    for _ in range(steps):
        traffic.arrive(rng.choice([0, 1, 2]))
        outs = traffic.scheduler.schedule()
        step = {"scheduled": [g.request_id for g in outs.scheduled_seq_groups],
                "prompt_run": outs.prompt_run, "preempted": outs.preempted,
                "blocks_to_swap_in": outs.blocks_to_swap_in,
                "blocks_to_swap_out": outs.blocks_to_swap_out,
                "blocks_to_copy": outs.blocks_to_copy, "finished": []}
        yield traffic, step
        traffic.after_model(outs)


@pytest.mark.parametrize("seed", range(6))
def test_block_tables_and_scheduler_views_have_clean_labels(seed):
    for traffic, step in random_runs(seed, 12):
        snap = traffic.bm.snapshot()
        assert_clean_layout(render_block_tables(snap, title=f"seed {seed}"), "block tables")
        assert_clean_layout(render_scheduler(traffic.scheduler.snapshot(), title="queues",
                                             step=step), "scheduler")


def test_block_tables_with_large_block_numbers_and_shared_blocks():
    from minipaged.lab.dry_run import DryRun
    run = DryRun(block_size=16, num_gpu_blocks=1456)
    run.block_manager.gpu_allocator.free_blocks.reverse()  # hand out blocks #1455, #1454, ...
    run.add_request(list(range(40)), n=3)
    run.step()
    run.step()
    assert_clean_layout(render_block_tables(run.block_manager.snapshot(), title="shared"),
                        "block tables")


def test_butterfly_title_and_lanes_stay_inside():
    rng = __import__("numpy").random.default_rng(0)
    trace = []
    emu.butterfly_reduce(rng.standard_normal(32).astype("float32"), op="max", trace=trace)
    records = butterfly_steps(trace)
    svg = render_butterfly(records, title="max over the warp: a butterfly of __shfl_xor_sync, "
                                          "masks 16, 8, 4, 2, 1")
    assert_clean_layout(svg, "butterfly")


def test_memory_waste_view_has_clean_labels():
    trace = kv_memory.request_trace(60, seed=1)
    svg = render_memory_waste(kv_memory.contiguous_waste(trace, 8192),
                              kv_memory.paged_waste(trace, 8192, 16), title="waste")
    assert_clean_layout(svg, "memory waste")


@pytest.mark.parametrize("seed", range(4))
def test_line_chart_has_clean_labels(seed):
    rng = random.Random(seed)
    series = {f"series {i} " + "x" * rng.randint(0, 30): [(x, rng.uniform(0.01, 1000))
                                                       for x in sorted(rng.sample(range(1, 300), 6))]
              for i in range(rng.randint(1, 5))}
    svg = render_line_chart(series, title="a chart", x_label="tokens", y_label="ms",
                            log_y=bool(seed % 2), marks=[(150, "crossover")])
    assert_clean_layout(svg, "line chart")


@pytest.mark.parametrize("seed", range(4))
def test_timeline_and_flat_batch_views_have_clean_labels(seed):
    import torch

    from minipaged.lab.batch_inputs import prepare_inputs_for_groups
    from visualizer.flat_batch import render_flat_batch
    from visualizer.timeline import render_timeline

    snapshots, arrivals = [], {}
    for step, (traffic, info) in enumerate(random_runs(seed, 14), start=1):
        sched = traffic.scheduler
        groups = sched.running
        batch = prepare_inputs_for_groups([g for g in groups], traffic.bm, traffic.block_size,
                                          torch.device("cpu"))
        if batch.rows:
            assert_clean_layout(render_flat_batch(batch, traffic.block_size, title="a step"),
                                "flat batch")
        for rid in [g.request_id for q in (sched.waiting, sched.running, sched.swapped)
                    for g in q]:
            arrivals.setdefault(rid, step)
        snapshots.append(type("Snap", (), {"step": step, "scheduled": info["scheduled"],
                                           "prompt_run": info["prompt_run"],
                                           "preempted": info["preempted"], "finished": []}))
    assert_clean_layout(render_timeline(snapshots, arrivals, title="timeline"), "timeline")
    # Two runs drawn on one step axis (lesson 09: static against continuous batching) have
    # the same columns and width, even when one run is shorter and started at another step.
    short = [type("Snap", (), dict(vars(s), step=s.step + 100)) for s in snapshots[:6]]
    later = {rid: step + 100 for rid, step in arrivals.items() if step <= 6}
    both = [ET.fromstring(render_timeline(run, arr, title=name, num_steps=len(snapshots)))
            for run, arr, name in ((snapshots, arrivals, "long"), (short, later, "short"))]
    assert len({(r.get("width"), r.get("data-num-steps")) for r in both}) == 1
    assert [t.text for t in both[1].iter(NS + "text") if t.get("class") == "tick"][0] == "1"


def test_show_source_keeps_listings_to_40_lines(monkeypatch):
    from minipaged.core.scheduler import Scheduler
    from visualizer import source

    shown = []
    monkeypatch.setattr("IPython.display.display", shown.append)
    source.show_source(Scheduler.schedule, end="# 2.")
    source.show_source(Scheduler.schedule, start="# 3.")
    source.show_source(Scheduler._schedule_running, max_lines=20)  # cut, with a note
    lengths = [len(code.data.splitlines()) for code in shown]
    assert all(n <= source.MAX_LINES + 2 for n in lengths), lengths
    assert "more lines" in shown[-1].data
    assert "# 1." in shown[0].data and "# 2." not in shown[0].data


def random_cached_runs(seed: int, steps: int):
    """Block-manager states of random traffic with prefix caching on: prompts start with one of
    two shared system prompts, so full blocks become cached, shared by hash, evictable (their
    requests finished) and evicted (a later allocation needed them)."""
    from minipaged.core.block_manager import BlockSpaceManager
    from minipaged.core.scheduler import Scheduler, SchedulerConfig

    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    num_gpu_blocks = rng.choice([12, 24, 40])
    mode = rng.choice(["swap", "recompute"])
    traffic = RandomTraffic(rng, block_size, num_gpu_blocks, preemption_mode=mode)
    traffic.block_manager = traffic.bm = BlockSpaceManager(
        block_size, num_gpu_blocks, 4 * num_gpu_blocks, watermark=0.0, enable_prefix_caching=True)
    traffic.scheduler = Scheduler(SchedulerConfig(preemption_mode=mode), traffic.bm)
    systems = [[rng.randrange(1000) for _ in range(rng.randint(1, 3) * block_size)]
               for _ in range(2)]
    for _ in range(steps):
        for _ in range(rng.choice([0, 1, 1, 2])):
            question = [rng.randrange(1000) for _ in range(rng.randint(1, 2 * block_size))]
            traffic.add_request(rng.choice(systems) + question)
        outs = traffic.scheduler.schedule()
        yield traffic
        traffic.after_model(outs)


@pytest.mark.parametrize("seed", range(6))
def test_block_tables_with_cached_and_evictable_blocks_have_clean_labels(seed):
    seen = {"cached": 0, "evictable": 0, "shared": 0}
    for traffic in random_cached_runs(seed, 16):
        snap = traffic.bm.snapshot()
        for b in snap["gpu_blocks"]:
            seen["cached"] += b["cached"] and b["ref_count"] > 0
            seen["evictable"] += b["evictable"]
            seen["shared"] += b["ref_count"] > 1
        svg = render_block_tables(snap, title=f"prefix caching, seed {seed}")
        assert_clean_layout(svg, "block tables with a prefix cache")
        assert float(ET.fromstring(svg).get("width")) <= 800
    assert all(seen.values()), seen  # the states really held every kind of block


def _looks_of_the_legend(root):
    looks = {}
    for entry in root.iter(NS + "g"):
        if entry.get("class") == "legend-entry":
            swatch = entry.find(NS + "rect")
            looks[entry.get("data-kind")] = (swatch.get("fill"), swatch.get("stroke"),
                                             swatch.get("stroke-dasharray"),
                                             swatch.get("stroke-width"), swatch.get("width"))
    return looks


def _blocks(root, kind):
    return [g for g in root.iter(NS + "g") if kind in (g.get("class") or "").split()]


def _rect(block, cls):
    return next(r for r in block.iter(NS + "rect") if r.get("class") == cls)


@pytest.mark.parametrize("seed", range(4))
def test_cached_and_evictable_blocks_are_coloured_as_the_legend_says(seed):
    checked = {"cached": 0, "evictable": 0, "free": 0, "shared": 0}
    for traffic in random_cached_runs(seed, 16):
        snap = traffic.bm.snapshot()
        root = ET.fromstring(render_block_tables(snap, max_pool_blocks=1000))
        looks = _looks_of_the_legend(root)
        assert set(looks) == set(LOOKS)  # every kind, on every picture
        by_number = {b["block_number"]: b for b in snap["gpu_blocks"]}
        for block in _blocks(root, "physical-block"):
            if block.get("data-device") != "gpu":
                continue
            info = by_number[int(block.get("data-block"))]
            classes = block.get("class").split()
            assert ("cached-block" in classes) == info["cached"]
            assert ("evictable-block" in classes) == info["evictable"]
            mark = next((t for t in block.iter(NS + "text") if t.get("class") == "cached-mark"),
                        None)
            if info["cached"]:
                kind = "evictable" if info["evictable"] else "cached"
                fill, stroke, dash = looks[kind][:3]
                outline = _rect(block, "cached-outline")
                assert (outline.get("stroke"), outline.get("stroke-dasharray")) == (stroke, dash)
                assert mark is not None and mark.text == kind and mark.get("fill") == stroke
                assert block.get("data-hash") == str(info["block_hash"])
                if kind == "evictable":  # free, so filled like a free block, outlined in green
                    assert _rect(block, "block-body").get("fill") == fill
                checked[kind] += 1
            else:
                assert mark is None
            if info["ref_count"] == 0 and not info["cached"]:
                body = _rect(block, "block-body")
                assert (body.get("fill"), body.get("stroke")) == looks["free"][:2]
                checked["free"] += 1
            if info["ref_count"] > 1:
                outline = _rect(block, "block-outline")
                assert (outline.get("stroke"), outline.get("stroke-dasharray")) == (
                    looks["shared"][1], looks["shared"][2])
                checked["shared"] += 1
    assert looks["cached"][1] == looks["evictable"][1] != looks["free"][1]  # green, not grey
    assert all(checked.values()), checked


def test_legend_swatches_of_different_states_differ():
    """Every kind of the legend looks its own way (fill, outline, dashes, width, size)."""
    traffic = next(random_cached_runs(0, 1))
    looks = _looks_of_the_legend(ET.fromstring(render_block_tables(traffic.bm.snapshot())))
    assert len(looks) == len(LOOKS) and len(set(looks.values())) == len(LOOKS), looks
    assert looks["cached"][0] != looks["evictable"][0]  # coloured as its owners vs grey


def test_a_compact_pool_still_draws_the_evictable_blocks():
    """Lesson 11 draws 16 blocks of a 48-block pool after a request finished: the evictable
    blocks it talks about stand last in the free list, but they are drawn."""
    from minipaged import SamplingParams
    from minipaged.core.block_manager import BlockSpaceManager
    from minipaged.sequence import Sequence, SequenceGroup

    bm = BlockSpaceManager(16, 48, 0, watermark=0.0, enable_prefix_caching=True)
    seq = Sequence(0, None, list(range(90)), 16)
    bm.allocate(SequenceGroup("0", [seq], SamplingParams(), arrival_time=0.0))
    bm.cache_blocks(seq, 90)  # its prompt was computed: the 5 full blocks are named
    bm.free(seq)  # the request finished
    snap = bm.snapshot()
    evictable = {b["block_number"] for b in snap["gpu_blocks"] if b["evictable"]}
    assert len(evictable) == 5, evictable
    root = ET.fromstring(render_block_tables(snap, max_pool_blocks=16))
    drawn = {int(g.get("data-block")) for g in _blocks(root, "evictable-block")}
    assert drawn == evictable


def test_block_tables_fit_a_jupyterlab_output_area():
    """A 48-block pool (lesson 11) and a 1456-block one (drawn compactly) stay within 800 px, and
    every pool block of the drawing lies inside it."""
    from minipaged.lab.dry_run import DryRun

    for num_blocks, limit in ((48, 128), (1456, 24)):
        run = DryRun(block_size=16, num_gpu_blocks=num_blocks)
        run.add_request(list(range(40)), n=2)
        run.step()
        root = ET.fromstring(render_block_tables(run.block_manager.snapshot(),
                                                 title="a pool that wraps",
                                                 max_pool_blocks=limit))
        width = float(root.get("width"))
        assert width <= 800
        for block in _blocks(root, "physical-block"):
            body = next(block.iter(NS + "rect"))
            assert float(body.get("x")) + float(body.get("width")) <= width


def test_views_with_server_request_ids_have_clean_labels():
    """The server names requests 'chatcmpl-<32 hex digits>-0': the badges and the sequence labels
    shorten them instead of writing over the next column or the pool."""
    from minipaged.lab.dry_run import DryRun

    run = DryRun(block_size=16, num_gpu_blocks=40, num_cpu_blocks=8)
    rng = random.Random(0)
    for _ in range(4):
        rid = f"chatcmpl-{rng.getrandbits(128):032x}-0"
        run.add_request([rng.randrange(1000) for _ in range(rng.randint(5, 40))], request_id=rid)
    outs = run.step()
    step = {"scheduled": [g.request_id for g in outs.scheduled_seq_groups],
            "prompt_run": outs.prompt_run, "preempted": [], "finished": []}
    assert_clean_layout(render_scheduler(run.scheduler.snapshot(), title="served", step=step),
                        "scheduler")
    assert_clean_layout(render_block_tables(run.block_manager.snapshot(), title="served"),
                        "block tables")
