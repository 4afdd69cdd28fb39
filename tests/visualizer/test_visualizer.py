"""The visualizers draw what the engine's snapshots say.

Every snapshot here comes from real block-manager, scheduler or engine operations; the SVG is
parsed back with xml.etree and its ``class`` / ``data-*`` attributes are compared with the
snapshot: how many physical blocks are drawn, the ref count written on each, which are marked
shared, what the free list and the queues hold.
"""
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from minipaged import LLM, SamplingParams
from minipaged.lab import emulator as emu
from minipaged.lab import kv_memory
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.scheduler import Scheduler, SchedulerConfig
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from visualizer import (EventRecorder, butterfly_steps, fork_tree_dot, fork_tree_nodes,
                        fork_tree_text, render_block_tables, render_butterfly,
                        render_fork_tree, render_memory_waste, render_scheduler,
                        show_fork_tree)

NS = "{http://www.w3.org/2000/svg}"


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)  # must be well-formed XML
    assert root.tag == NS + "svg"
    return root


def by_class(root: ET.Element, cls: str, **data) -> list[ET.Element]:
    """Elements whose class list contains ``cls`` and whose data-* attributes match ``data``."""
    found = []
    for node in root.iter():
        if cls in node.get("class", "").split() and all(
                node.get("data-" + k.replace("_", "-")) == str(v) for k, v in data.items()):
            found.append(node)
    return found


def drawn_pool(root, device="gpu") -> dict[int, dict]:
    """{block number: its drawn attributes} for one pool."""
    return {int(b.get("data-block")): {"ref": int(b.get("data-ref")),
                                       "shared": b.get("data-shared") == "1",
                                       "free": "free-block" in b.get("class").split(),
                                       "owners": b.get("data-owners")}
            for b in by_class(root, "physical-block", device=device)}


def assert_draws_held_blocks(root, snap) -> None:
    """Every held GPU block is drawn with its ref count (free ones may be left out)."""
    pool = drawn_pool(root, "gpu")
    for block in snap["gpu_blocks"]:
        if block["ref_count"]:
            assert pool[block["block_number"]]["ref"] == block["ref_count"]


def ref_texts(root, number) -> list[str]:
    block = by_class(root, "physical-block", block=number, device="gpu")[0]
    return [t.text for t in by_class(block, "ref-count")]


def make_group(request_id, prompt, block_size, n=1, first_seq_id=0, arrival=0.0):
    seqs = [Sequence(first_seq_id + i, None, prompt, block_size) for i in range(n)]
    return SequenceGroup(request_id, seqs, SamplingParams(n=n), arrival)


def admit(bm, group):
    bm.allocate(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = seq.get_len()


def grow(bm, seq, token):
    """What the engine does for one decode step of one sequence."""
    seq.append_token_id(token, {token: 0.0})
    return bm.append_slot(seq)


# ----------------------------------------------------------------------------------------------
# block tables
# ----------------------------------------------------------------------------------------------
@pytest.mark.lesson02
def test_block_tables_draw_every_physical_block_with_its_ref_count():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=10, num_cpu_blocks=3, watermark=0)
    a = make_group("0", list(range(100, 109)), 4)  # 9 tokens: 3 blocks
    b = make_group("1", list(range(200, 203)), 4, first_seq_id=1)  # 3 tokens: 1 block
    admit(bm, a)
    admit(bm, b)
    grow(bm, b.seqs[0], 7)  # fills b's block
    grow(bm, b.seqs[0], 8)  # opens a new block
    snap = bm.snapshot()
    root = parse(render_block_tables(snap))

    pool = drawn_pool(root, "gpu")
    assert len(pool) == 10 and len(drawn_pool(root, "cpu")) == 3
    for block in snap["gpu_blocks"]:
        drawn = pool[block["block_number"]]
        assert drawn["ref"] == block["ref_count"]
        assert drawn["free"] == (block["ref_count"] == 0)
        assert ref_texts(root, block["block_number"]) == [f"ref {block['ref_count']}"]
    assert sorted(n for n, d in pool.items() if d["free"]) == sorted(snap["free_gpu_blocks"])
    assert not by_class(root, "shared-block")  # nothing is shared yet

    # the block table column: one entry per table slot, naming the physical block
    for seq in (a.seqs[0], b.seqs[0]):
        entries = by_class(root, "table-entry", seq=seq.seq_id)
        assert [int(e.get("data-block")) for e in entries] == bm.get_block_table(seq)
        logical = by_class(root, "logical-block", seq=seq.seq_id)
        assert [int(e.get("data-filled")) for e in logical] == \
            [blk.num_tokens for blk in seq.logical_token_blocks]

    # the free list is drawn as a queue, next-to-be-allocated first
    queue = by_class(root, "free-list-entry")
    assert [int(e.get("data-block")) for e in queue] == snap["free_gpu_blocks"]
    assert [int(e.get("data-position")) for e in queue] == list(range(len(queue)))
    assert root.get("data-num-free-gpu-blocks") == str(bm.get_num_free_gpu_blocks())


@pytest.mark.lesson02
def test_newest_token_is_highlighted_once_per_sequence_in_its_logical_block():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=6, num_cpu_blocks=0, watermark=0)
    a = make_group("0", [1, 2, 3, 4, 5, 6], 4)
    admit(bm, a)
    grow(bm, a.seqs[0], 9)  # 7 tokens: the newest is slot 2 of logical block 1
    root = parse(render_block_tables(bm.snapshot()))
    logical = by_class(root, "logical-block", seq=0)
    assert [len(by_class(lb, "newest-token")) for lb in logical] == [0, 1]
    # the same slot is outlined in the physical block that stores it
    physical = by_class(root, "physical-block", block=bm.get_block_table(a.seqs[0])[1])[0]
    assert len(by_class(physical, "newest-token")) == 1


@pytest.mark.lesson02
def test_large_pool_is_elided_but_every_held_block_is_drawn():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=500, num_cpu_blocks=0, watermark=0)
    admit(bm, make_group("0", list(range(30)), 4))  # 8 blocks
    root = parse(render_block_tables(bm.snapshot(), max_pool_blocks=20))
    pool = drawn_pool(root)
    assert len(pool) == 20
    assert sum(not d["free"] for d in pool.values()) == 8
    assert by_class(root, "pool-elided")[0].get("data-count") == "480"
    assert root.get("data-num-gpu-blocks") == "500"


@pytest.mark.lesson03
def test_fork_marks_shared_blocks_and_copy_on_write_unshares_the_last_one():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0)
    group = make_group("0", list(range(10, 16)), 4)  # 6 tokens: blocks of 4 + 2
    admit(bm, group)
    parent = group.seqs[0]
    child = Sequence(1, None, parent.prompt_token_ids, 4)
    child.status = SequenceStatus.RUNNING
    group.seqs.append(child)
    recorder = EventRecorder(bm)
    bm.fork(parent, child)

    root = parse(render_block_tables(bm.snapshot()))
    table = bm.get_block_table(parent)
    shared = {int(b.get("data-block")) for b in by_class(root, "shared-block")}
    assert shared == set(table)
    for number in table:
        assert ref_texts(root, number) == ["ref 2"]
        assert by_class(root, "physical-block", block=number)[0].get("data-owners") == "0,1"
        assert len(by_class(by_class(root, "physical-block", block=number)[0],
                            "shared-mark")) == 1

    # The child writes first: its last block is shared, so it is copied.
    cow = grow(bm, child, 99)
    assert cow is not None
    src, dst = cow
    root = parse(render_block_tables(bm.snapshot(), highlight_blocks=[src, dst]))
    pool = drawn_pool(root)
    assert pool[src] == {"ref": 1, "shared": False, "free": False, "owners": "0"}
    assert pool[dst] == {"ref": 1, "shared": False, "free": False, "owners": "1"}
    assert {int(b.get("data-block")) for b in by_class(root, "shared-block")} == {table[0]}
    assert {int(e.get("data-block")) for e in by_class(root, "event-block")} == {src, dst}
    assert recorder[-1].caption == (f"step 2: seq 1 appends token 99; block {src} is shared, "
                                    f"copy-on-write to block {dst}")
    assert [s.event["op"] for s in recorder] == ["start", "fork", "copy_on_write"]


@pytest.mark.lesson04
def test_swapped_sequence_is_drawn_in_the_cpu_pool():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=6, num_cpu_blocks=6, watermark=0)
    group = make_group("0", list(range(9)), 4, n=2)  # 3 shared blocks, ref count 2
    admit(bm, group)
    bm.swap_out(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.SWAPPED
    snap = bm.snapshot()
    root = parse(render_block_tables(snap))
    gpu, cpu = drawn_pool(root, "gpu"), drawn_pool(root, "cpu")
    assert all(d["free"] for d in gpu.values())
    held = {n: d for n, d in cpu.items() if not d["free"]}
    assert len(held) == 3 and all(d["ref"] == 2 and d["shared"] for d in held.values())
    for seq in group.get_seqs():
        entries = by_class(root, "table-entry", seq=seq.seq_id)
        assert {e.get("data-device") for e in entries} == {"cpu"}
        assert [int(e.get("data-block")) for e in entries] == bm.get_block_table(seq)
    assert by_class(root, "sequence", seq=0)[0].get("data-status") == "SWAPPED"


# ----------------------------------------------------------------------------------------------
# scheduler view
# ----------------------------------------------------------------------------------------------
def badges(root, queue):
    return [b.get("data-request") for b in by_class(root, "badge", queue=queue)]


@pytest.mark.lesson04
def test_scheduler_view_shows_the_three_queues_and_pool_occupancy():
    bm = BlockSpaceManager(block_size=2, num_gpu_blocks=4, num_cpu_blocks=8, watermark=0)
    sched = Scheduler(SchedulerConfig(preemption_mode="swap"), bm)
    a, b = make_group("a", [1, 2, 3], 2), make_group("b", [4, 5, 6], 2, first_seq_id=1,
                                                        arrival=1.0)
    c = make_group("c", list(range(10, 20)), 2, first_seq_id=2, arrival=2.0)
    for g in (a, b, c):
        sched.add_seq_group(g)

    def decode_step(outs, token):
        for g in outs.scheduled_seq_groups:
            for seq in g.get_seqs(SequenceStatus.RUNNING):
                seq.num_computed_tokens = seq.get_len()
                seq.append_token_id(token, {token: 0.0})

    outs = sched.schedule()  # a and b fit (2 blocks each), c (5 blocks) must wait
    root = parse(render_scheduler(sched.snapshot()))
    assert badges(root, "running") == ["a", "b"] and badges(root, "waiting") == ["c"]
    assert badges(root, "swapped") == []
    decode_step(outs, 7)  # 4 tokens each: still 2 blocks
    outs = sched.schedule()
    decode_step(outs, 8)  # 5 tokens each: both need a third block, only one can have it
    outs = sched.schedule()
    assert outs.preempted == [("b", "swap")]

    snap = sched.snapshot()
    step = {"scheduled": [g.request_id for g in outs.scheduled_seq_groups],
            "prompt_run": outs.prompt_run, "preempted": outs.preempted,
            "blocks_to_swap_out": outs.blocks_to_swap_out}
    root = parse(render_scheduler(snap, title="after preemption", step=step))
    assert badges(root, "running") == ["a"]
    assert badges(root, "swapped") == ["b"]
    assert badges(root, "waiting") == ["c"]
    assert by_class(root, "badge", request="b")[0].get("data-preempted") == "swap"
    assert by_class(root, "badge", request="a")[0].get("data-num-tokens") == "5"
    assert by_class(root, "queue", queue="swapped")[0].get("data-count") == "1"
    gpu_bar = by_class(root, "pool-bar", pool="gpu")[0]
    cpu_bar = by_class(root, "pool-bar", pool="cpu")[0]
    assert (gpu_bar.get("data-used"), gpu_bar.get("data-total")) == ("3", "4")
    assert (cpu_bar.get("data-used"), cpu_bar.get("data-total")) == ("2", "8")
    notes = [t.text for t in by_class(root, "step-note")]
    assert any(n.startswith("swap out GPU→CPU") for n in notes)


# ----------------------------------------------------------------------------------------------
# butterfly
# ----------------------------------------------------------------------------------------------
@pytest.mark.lesson05
def test_butterfly_view_draws_each_lane_exchange_of_each_mask():
    trace = []
    values = np.arange(32, dtype=np.float32)
    result = emu.butterfly_reduce(values, "sum", trace=trace, phase="sum")
    records = butterfly_steps(trace)
    root = parse(render_butterfly(records, title="sum of 0..31"))
    assert root.get("data-masks") == "16,8,4,2,1"
    for step, mask in enumerate((16, 8, 4, 2, 1)):
        lines = by_class(root, "exchange", step=step)
        assert len(lines) == 32
        assert all(int(e.get("data-partner")) == int(e.get("data-lane")) ^ mask for e in lines)
    last_column = by_class(root, "lane-value", column=5)
    assert {e.get("data-value") for e in last_column} == {"496"} == {f"{result[0]:.4g}"}
    first_column = by_class(root, "lane-value", column=0)
    assert [e.get("data-value") for e in first_column] == [str(i) for i in range(32)]


@pytest.mark.lesson05
def test_butterfly_team_colours_are_unique_per_team():
    """In every column, two lanes share a colour exactly when they are in one team (lanes 0 and
    10 after mask 16 are two teams: they must not look like one)."""
    trace = []
    emu.butterfly_reduce(np.arange(32, dtype=np.float32), "max", trace=trace, phase="max")
    root = parse(render_butterfly(butterfly_steps(trace)))
    for column in range(1, 6):
        cells = by_class(root, "lane-value", column=column)
        fill_of_team = {}
        for cell in cells:
            fill_of_team.setdefault(cell.get("data-team"), set()).add(cell.get("data-fill"))
        assert all(len(fills) == 1 for fills in fill_of_team.values())
        fills = [next(iter(f)) for f in fill_of_team.values()]
        assert len(set(fills)) == len(fills) == 32 >> column, (column, fills)


@pytest.mark.lesson05
def test_butterfly_steps_picks_one_reduction_out_of_a_kernel_trace():
    rng = np.random.default_rng(0)
    block_size, x, head_size = 16, 4, 64
    key_cache = rng.standard_normal((4, 1, head_size // x, block_size, x)).astype(np.float32)
    value_cache = rng.standard_normal((4, 1, head_size, block_size)).astype(np.float32)
    query = rng.standard_normal((1, 1, head_size)).astype(np.float32)
    trace = []
    emu.paged_attention(query, key_cache, value_cache, np.array([[2, 0, 3]]), np.array([40]),
                        head_size ** -0.5, trace=trace)
    records = butterfly_steps(trace, phase="max", stage="warp", warp=1)
    # G = 32 // 16 = 2 lanes per token: the max butterfly stops at mask G
    assert [r["mask"] for r in records] == [16, 8, 4, 2]
    root = parse(render_butterfly(records))
    assert root.get("data-phase") == "max" and root.get("data-num-steps") == "4"
    with pytest.raises(ValueError):
        butterfly_steps(trace, phase="max", warp=9)


# ----------------------------------------------------------------------------------------------
# memory waste
# ----------------------------------------------------------------------------------------------
@pytest.mark.lesson01
def test_memory_waste_view_draws_the_fractions_kv_cache_computes():
    trace = kv_memory.request_trace(60, seed=1)
    contiguous = kv_memory.contiguous_waste(trace, capacity=8192)
    paged = kv_memory.paged_waste(trace, capacity=8192, block_size=16)
    root = parse(render_memory_waste(contiguous, paged))
    for report in (contiguous, paged):
        bar = by_class(root, "waste-bar", scheme=report.scheme)[0]
        assert float(bar.get("data-waste")) == pytest.approx(report.waste_fraction, abs=1e-4)
        for kind in kv_memory.KINDS:
            seg = by_class(bar, "segment", kind=kind)[0]
            assert float(seg.get("data-fraction")) == pytest.approx(report.fraction(kind),
                                                                    abs=1e-4)
        runs = by_class(by_class(root, "memory-map", scheme=report.scheme)[0], "map-run")
        assert sum(int(r.get("data-slots")) for r in runs) == report.capacity
    paged_runs = by_class(by_class(root, "memory-map", scheme="paged")[0], "map-run")
    assert not [r for r in paged_runs if r.get("data-kind") in ("reserved", "external")]


# ----------------------------------------------------------------------------------------------
# recording, the player widget and the fork tree
# ----------------------------------------------------------------------------------------------
@pytest.mark.lesson02
def test_event_player_moves_through_the_recording():
    pytest.importorskip("ipywidgets")
    from visualizer.widgets import EventPlayer

    bm = BlockSpaceManager(block_size=2, num_gpu_blocks=6, num_cpu_blocks=0, watermark=0)
    recorder = EventRecorder(bm)
    group = make_group("0", [1, 2, 3], 2)
    admit(bm, group)
    grow(bm, group.seqs[0], 4)
    grow(bm, group.seqs[0], 5)
    bm.free(group.seqs[0])
    recorder.detach()
    admit(bm, make_group("1", [1], 2, first_seq_id=1))  # not recorded any more
    assert [s.event["op"] for s in recorder] == ["start", "allocate", "append", "append", "free"]
    assert recorder[2].caption == "step 2: seq 0 appends token 4 into block 1 (slot 2 of 2)"
    assert recorder[3].caption == "step 3: seq 0 appends token 5; its last block was full, " \
                                  "new block 2"

    player = EventPlayer(recorder)
    assert player.slider.max == 4
    frames = []
    for i in range(5):
        player.slider.value = i
        assert recorder[i].caption in player.caption.value
        frames.append(player.view.value)
        root = parse(player.render(i))
        assert root.get("data-num-free-gpu-blocks") == \
            str(len(recorder[i].blocks["free_gpu_blocks"]))
    assert len(set(frames)) == 5


@pytest.mark.lesson03
def test_fork_tree_of_beam_search(tiny_llama, capsys, monkeypatch):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, num_gpu_blocks=64, num_cpu_blocks=8, max_model_len=128)
    recorder = EventRecorder.for_engine(llm.llm_engine)
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=6,
                            ignore_eos=True)
    llm.generate(prompt_token_ids=[[3, 4, 5, 6, 7]], sampling_params=params, use_tqdm=False)
    nodes = fork_tree_nodes(recorder, "0")
    forks = [s for s in recorder if s.event["op"] == "fork"]
    assert len(nodes) == 1 + 3 + len(forks)  # prompt, the 3 first beams, one node per fork
    assert sum(n.state == "final" for n in nodes) == 3
    text = fork_tree_text(nodes)
    assert text.splitlines()[0].startswith("request 0: prompt of 5 tokens")
    assert len(text.splitlines()) == len(nodes)
    assert fork_tree_dot(nodes).count("->") == len(nodes) - 1
    # A legend says what the looks and the names (seq 4b) mean, one entry per kind of node.
    dot = fork_tree_dot(nodes)
    assert "cluster_legend" in dot and "seq 4b: seq 4's second life" in dot
    assert all(f"legend_{kind} " in dot for kind in ("root", "live", "final", "dropped"))
    assert 'size="8,40"' in dot  # graphviz scales a wider tree down to 8 inches
    if render_fork_tree(nodes) is not None:  # graphviz's dot is installed
        assert ET.fromstring(render_fork_tree(nodes)).tag == NS + "svg"

    # The notebook's view needs no graphviz: our own SVG, shown with IPython's display.
    shown = []
    monkeypatch.setattr("visualizer.fork_tree.shutil.which", lambda name: None)
    monkeypatch.setattr("IPython.display.display", shown.append)
    show_fork_tree(recorder, "0")
    svg, = shown
    root = parse(svg.data)
    assert len(by_class(root, "fork-node")) == len(nodes)
    assert capsys.readouterr().out == ""


# ----------------------------------------------------------------------------------------------
# live mode
# ----------------------------------------------------------------------------------------------
@pytest.mark.lesson08
def test_live_view_redraws_once_per_engine_step_then_stays_on_the_busiest(tiny_llama):
    pytest.importorskip("ipywidgets")
    from visualizer.widgets import LiveBlockTableView, held_blocks

    path, _ = tiny_llama
    llm = LLM(path, block_size=4, num_gpu_blocks=12, num_cpu_blocks=12, max_model_len=48)
    engine = llm.llm_engine
    view = LiveBlockTableView(engine, show_scheduler=True, seconds_per_step=0)
    assert view.num_redraws == 0

    # Step by hand: after each step the drawing is the block manager's current state.
    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, ignore_eos=True)
    engine.add_request(None, None, params, prompt_token_ids=[5, 6, 7, 8, 9, 10])
    engine.add_request(None, None, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                       prompt_token_ids=[11, 12, 13])
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert view.num_redraws == steps
        root = parse(view.last_svg)
        assert_draws_held_blocks(root, engine.block_manager.snapshot())
        assert root.get("data-num-free-gpu-blocks") == \
            str(engine.block_manager.get_num_free_gpu_blocks())
        assert len(by_class(root, "sequence")) == len(engine.block_manager.block_tables)
        if engine.has_unfinished_requests():
            assert view.last_svg in view.view.value  # the widget shows it
    assert steps == engine.stats.num_steps == 9
    # The run is over: the view shows the step that held the most blocks, not the empty pool.
    most = max(held_blocks(f) for f in view.frames)
    # The slider counts engine steps (the caption's number), as StepPlayer's does.
    shown = next(f for f in view.frames if f.step == view.step_slider.value)
    assert most > 0 and held_blocks(shown) == most
    assert (view.step_slider.min, view.step_slider.max) == (1, engine.stats.num_steps)
    assert view.shown_step == view.step_slider.value
    assert f"engine step {view.shown_step}:" in view.caption.value
    assert "the most blocks" in view.caption.value and view.last_svg not in view.view.value
    view.step_slider.value = engine.stats.num_steps  # the replay draws any kept step
    assert view.shown_step == engine.stats.num_steps and view.last_svg in view.view.value

    # And through generate(): still one redraw per step; the last drawing is the final state.
    before = view.num_redraws
    llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5, 6, 7, 8]],
                 sampling_params=SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert view.num_redraws - before == engine.stats.num_steps - steps
    root = parse(view.last_svg)
    assert_draws_held_blocks(root, engine.block_manager.snapshot())
    assert len(by_class(root, "free-block", device="gpu")) == 12
    assert not by_class(root, "sequence")

    view.detach()
    # By default a person can follow it: lesson 08's view pauses after each step.
    from visualizer.widgets import SECONDS_PER_STEP
    default = LiveBlockTableView(engine)
    assert default.speed.value == SECONDS_PER_STEP >= 0.3
    default.detach()
    llm.generate(prompt_token_ids=[[1, 2]],
                 sampling_params=SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert view.num_redraws - before == engine.stats.num_steps - steps - 2


def test_engine_never_imports_the_visualizer_or_ipywidgets():
    code = ("import sys, minipaged, minipaged.engine.llm_engine, minipaged.entrypoints.llm, minipaged.lab.kv_memory; "
            "bad = [m for m in ('ipywidgets', 'visualizer', 'IPython') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.lesson03
def test_fork_tree_names_every_node_once(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, num_gpu_blocks=64, num_cpu_blocks=8, max_model_len=128)
    recorder = EventRecorder.for_engine(llm.llm_engine)
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=6,
                            ignore_eos=True)
    llm.generate(prompt_token_ids=[[3, 4, 5, 6, 7]], sampling_params=params, use_tqdm=False)
    nodes = fork_tree_nodes(recorder, "0")
    names = [n.label.split(" (")[0] for n in nodes[1:]]
    assert len(set(names)) == len(names), names
    reused = [n for n in names if not n[-1].isdigit()]
    assert reused  # beam search reuses sequence ids, and the tree tells the lives apart


@pytest.mark.lesson08
def test_engine_views_draw_a_compact_pool_and_mark_blocks_entered_this_step():
    pytest.importorskip("ipywidgets")
    from minipaged.lab.dry_run import DryRun
    from visualizer.legend import step_marks
    from visualizer.widgets import COMPACT_POOL

    run = DryRun(block_size=4, num_gpu_blocks=1456)
    seq = run.add_request([1, 2, 3]).seqs[0]
    snaps = []
    for _ in range(3):
        before = run.block_manager.snapshot()
        run.step()
        snaps.append(run.block_manager.snapshot())
    # step 1 admitted the prompt; step 3 stored the 5th token: a new block
    assert step_marks(before, snaps[-1])["new"] == [run.block_manager.get_block_table(seq)[-1]]
    root = parse(render_block_tables(snaps[-1], max_pool_blocks=COMPACT_POOL))
    assert len(drawn_pool(root)) == COMPACT_POOL  # not 1456 cells
    assert by_class(root, "pool-elided")[0].get("data-count") == str(1456 - COMPACT_POOL)


@pytest.mark.lesson04
def test_step_player_slider_shows_the_engine_step_number(tiny_llama):
    pytest.importorskip("ipywidgets")
    from visualizer.widgets import StepPlayer

    path, _ = tiny_llama
    llm = LLM(path, block_size=4, num_gpu_blocks=12, max_model_len=48)
    snaps = []
    llm.llm_engine.add_observer(snaps.append)
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(
        max_tokens=3, ignore_eos=True), use_tqdm=False)
    player = StepPlayer(snaps[1:])  # start at the second step: the slider still says its number
    assert (player.slider.min, player.slider.max) == (snaps[1].step, snaps[-1].step)
    for snap in snaps[1:]:
        player.slider.value = snap.step
        assert f"engine step {snap.step}:" in player.caption.value
    assert player.speed.value == player.play.interval
