"""One visual language: every block picture carries the legend of ``visualizer/legend.py``, and
its marks are the facts of the snapshots it is drawn from.

A small engine runs a workload that shares, copies, preempts (by swap and by recompute) and
frees blocks; every picture the lessons show of it (the step player's, the live view's, the
event player's) is parsed back and compared with the step's ``blocks_to_copy``, ``preempted``
and the block manager's snapshots before and after.
"""
import xml.etree.ElementTree as ET

import pytest

from minipaged import LLM, SamplingParams
from visualizer import EventRecorder, render_block_tables
from visualizer.legend import LOOKS, STEP_KINDS, snapshot_marks, step_marks

NS = "{http://www.w3.org/2000/svg}"


def _groups(root, cls):
    return [g for g in root.iter(NS + "g") if cls in (g.get("class") or "").split()]


def _legend(root) -> dict[str, bool]:
    return {e.get("data-kind"): e.get("data-present") == "1" for e in _groups(root, "legend-entry")}


def _drawn_marks(root) -> dict[str, set[int]]:
    marks = {kind: set() for kind in STEP_KINDS}
    for block in _groups(root, "physical-block"):
        if block.get("data-mark") and block.get("data-device") == "gpu":
            marks[block.get("data-mark")].add(int(block.get("data-block")))
    return marks


def assert_legend_and_marks(svg: str, previous: dict | None, snap) -> dict[str, set[int]]:
    """The picture of engine step ``snap`` has the whole legend, its marks are the step's facts,
    and each mark is drawn in the legend's look."""
    root = ET.fromstring(svg)
    legend = _legend(root)
    assert list(legend) == list(LOOKS), legend  # every kind, in the legend's order
    drawn = _drawn_marks(root)
    before = {b["block_number"]: b for b in previous["gpu_blocks"]} if previous else {}
    after = {b["block_number"]: b for b in snap.block_manager["gpu_blocks"]}
    copies = {d for ds in snap.blocks_to_copy.values() for d in ds}
    assert drawn["copied"] == copies  # the copy mark only on this step's copies
    gone = {str(r) for r, _ in snap.preempted}
    held_by_gone = {b for s in (previous or {}).get("sequences", []) if s["request_id"] in gone
                    and s["device"] == "gpu" for b in s["block_table"]}
    assert drawn["preempted"] == held_by_gone - copies
    for number in drawn["freed"]:
        assert before[number]["ref_count"] > 0 and after[number]["ref_count"] == 0
    for number in drawn["new"]:
        assert after[number]["ref_count"] > 0
    for block in _groups(root, "physical-block"):
        mark = block.get("data-mark")
        outline = [r for r in block.iter(NS + "rect") if "step-mark" in (r.get("class") or "")]
        if mark is None:
            assert not outline
            continue
        look = LOOKS[mark]
        assert (outline[0].get("stroke"), outline[0].get("stroke-dasharray")) == (
            look.stroke, look.dash)
    # The legend says which kinds this picture shows.
    for kind in STEP_KINDS:
        assert legend[kind] == bool(drawn[kind]), (kind, legend, drawn)
    shared = any(b["ref_count"] > 1 for b in after.values())
    assert legend["shared"] == shared
    return drawn


@pytest.fixture(scope="module")
def run(tiny_llama):
    """Engine steps of a workload that shares, copies, swaps, recomputes and frees."""
    path, _ = tiny_llama
    steps = {}
    for mode in ("swap", "recompute"):
        llm = LLM(path, block_size=4, num_gpu_blocks=10, num_cpu_blocks=16, max_model_len=32,
                  preemption_mode=mode)
        snaps = []
        llm.llm_engine.add_observer(snaps.append)
        recorder = EventRecorder.for_engine(llm.llm_engine)
        llm.generate(prompt_token_ids=[[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]],
                     sampling_params=[SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=9,
                                                     ignore_eos=True),
                                      SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                      SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)],
                     use_tqdm=False)
        steps[mode] = (llm, snaps, recorder)
    return steps


def test_the_step_player_s_pictures_carry_the_legend_and_the_step_s_facts(run):
    pytest.importorskip("ipywidgets")
    from visualizer.widgets import StepPlayer

    seen = {kind: 0 for kind in STEP_KINDS}
    for mode, (_, snaps, _) in run.items():
        assert any(s.preempted for s in snaps), f"{mode}: the workload preempts nothing"
        player = StepPlayer(snaps)
        for i, snap in enumerate(snaps):
            _, (_, tables) = player.frame(i)
            previous = snaps[i - 1].block_manager if i else None
            drawn = assert_legend_and_marks(tables, previous, snap)
            for kind in STEP_KINDS:
                seen[kind] += bool(drawn[kind])
    assert all(seen.values()), seen  # the workload really copied, preempted, took and freed


def test_a_step_without_copies_has_no_copy_mark_and_a_shared_block_is_not_one(run):
    """Lesson 16's view once outlined a shared block (ref 2) like a copy at a step with
    "copied {}": the copy mark is only on the step's copies, and shared looks unlike copied."""
    _, snaps, _ = run["swap"]
    quiet = [(i, s) for i, s in enumerate(snaps) if not s.blocks_to_copy
             and any(b["ref_count"] > 1 for b in s.block_manager["gpu_blocks"])]
    assert quiet, "no step with a shared block and no copy"
    for i, snap in quiet:
        svg = render_block_tables(snap.block_manager,
                                  marks=snapshot_marks(snaps[i - 1] if i else None, snap))
        root = ET.fromstring(svg)
        assert not _drawn_marks(root)["copied"] and not _legend(root)["copied"]
        for block in _groups(root, "shared-block"):
            outline = next(r for r in block.iter(NS + "rect")
                           if r.get("class") == "block-outline")
            assert (outline.get("stroke"), outline.get("stroke-dasharray")) != (
                LOOKS["copied"].stroke, LOOKS["copied"].dash)
    assert len({(look.stroke, look.dash, look.width) for look in LOOKS.values()}) == len(LOOKS)


def test_the_live_view_and_the_event_player_draw_the_same_legend(run, tiny_llama):
    pytest.importorskip("ipywidgets")
    from visualizer.widgets import EventPlayer, LiveBlockTableView

    llm, snaps, recorder = run["recompute"]
    player = EventPlayer(recorder)
    kinds_seen = set()
    for i, step in enumerate(recorder.steps):
        root = ET.fromstring(player.render(i))
        assert list(_legend(root)) == list(LOOKS)
        drawn = _drawn_marks(root)
        for kind, blocks in step.marks.items():
            assert drawn[kind] == set(blocks), (step.caption, kind, drawn)
            kinds_seen |= {kind} if blocks else set()
    assert kinds_seen >= {"new", "copied", "freed"}, kinds_seen

    path, _ = tiny_llama
    llm = LLM(path, block_size=4, num_gpu_blocks=10, max_model_len=32)
    view = LiveBlockTableView(llm.llm_engine, seconds_per_step=0)
    live = []
    llm.llm_engine.add_observer(lambda snap: live.append((view.last_svg, snap)))
    llm.generate(prompt_token_ids=[[1, 2, 3, 4, 5]], sampling_params=SamplingParams(
        n=2, temperature=1.0, seed=2, max_tokens=6, ignore_eos=True), use_tqdm=False)
    previous = None
    for svg, snap in live:
        assert_legend_and_marks(svg, previous, snap)
        previous = snap.block_manager


def test_marks_of_unknown_kinds_are_refused():
    with pytest.raises(ValueError, match="step kinds"):
        render_block_tables({"block_size": 4, "gpu_blocks": [], "cpu_blocks": [],
                             "free_gpu_blocks": [], "free_cpu_blocks": [], "sequences": []},
                            marks={"moved": [1]})
    assert step_marks(None, {"sequences": [], "gpu_blocks": []}) == {k: [] for k in STEP_KINDS}


def test_two_players_step_together(run):
    """Lesson 19: the reference's player and the suspect's move as one."""
    pytest.importorskip("ipywidgets")
    from visualizer.widgets import StepPlayer, step_together

    a, b = StepPlayer(run["swap"][1]), StepPlayer(run["recompute"][1][:4])
    box = step_together(a, b)
    assert list(box.children) == [a, b] and b.play.layout.display == "none"
    a.slider.value = 3
    assert b.slider.value == 3 and "engine step 3:" in b.caption.value
    a.slider.value = a.slider.max  # past the shorter run: it stays on its last step
    assert b.slider.value == b.slider.max == 4
    b.slider.value = 2
    assert a.slider.value == 2 and "engine step 2:" in a.caption.value
    with pytest.raises(ValueError, match="two players"):
        step_together(a)


def test_no_lesson_gives_a_mark_a_colour_or_word_of_its_own():
    """Every lesson's block pictures speak the legend's language: no lesson passes a colour of
    its own, and every highlight word is a kind of the legend."""
    import re
    from pathlib import Path

    import nbformat

    from visualizer.legend import MARK_WORDS

    lessons = sorted((Path(__file__).parents[2] / "lessons").glob("*.ipynb"))
    assert lessons
    for path in lessons:
        code = "\n".join(c.source for c in nbformat.read(path, 4).cells if c.cell_type == "code")
        assert "highlight_colour" not in code, path.name
        for word in re.findall(r"highlight_mark=\"(\w+)\"", code):
            assert word in MARK_WORDS, (path.name, word)
