"""Lesson 12's drawings show what the text says: the guesses in lookahead slots, the accepted
ones kept, the rejected ones rolled back, the freed blocks; the distributions' bars and ticks."""
import xml.etree.ElementTree as ET

import pytest
import torch

from visualizer.distributions import render_distributions
from visualizer.speculation import render_verification, verification_slots

pytestmark = pytest.mark.lesson12


def with_class(root, name):
    return [e for e in root.iter() if name in (e.get("class") or "").split()]


def a_verification(accepted: int):
    """Ten tokens before the step (the newest is 109), block size 4, four guesses 200..203 in
    the lookahead slots 10..13 (blocks #2 and #7); ``accepted`` of them kept."""
    proposed = [200, 201, 202, 203]
    emitted = proposed[:accepted] + [999 if accepted < 4 else 204]
    tokens = list(range(100, 110)) + emitted
    sequence = {"logical_blocks": [{"token_ids": tokens[i:i + 4]}
                                   for i in range(0, len(tokens), 4)]}
    after = [5, 9, 2, 7][:-(-len(tokens) // 4)]
    spec = {"proposed": proposed, "accepted": accepted, "emitted": emitted,
            "lookahead_slots": [2 * 4 + 2, 2 * 4 + 3, 7 * 4, 7 * 4 + 1],
            "blocks_before": [5, 9, 2, 7], "blocks_after": after}
    return sequence, spec


def test_a_rejection_at_the_first_guess_rolls_back_three_slots_and_frees_a_block():
    sequence, spec = a_verification(0)
    root = ET.fromstring(render_verification(sequence, spec, 4, decode=lambda t: f"w{t}"))
    before, after = with_class(root, "block-row")
    assert before.get("data-row") == "before" and after.get("data-row") == "after"
    kinds = lambda row: [s.get("data-kind") for s in with_class(row, "slot")]
    assert kinds(before).count("draft") == 4 and kinds(before).count("newest") == 1
    assert kinds(after).count("target") == 1 and kinds(after).count("rolled_back") == 1
    assert kinds(after).count("freed") == 4  # block #7 held only rejected guesses
    freed = [b for b in with_class(after, "block") if b.get("data-freed") == "1"]
    assert [b.get("data-block") for b in freed] == ["7"]
    assert "block #7 freed" in "".join(after.itertext())
    # the drawn blocks are those from the newest token's on: #2 and #7, not #5 and #9
    assert [b.get("data-block") for b in with_class(before, "block")] == ["2", "7"]


def test_accepted_guesses_stay_in_their_slots():
    sequence, spec = a_verification(2)
    slots = verification_slots(sequence, spec, 4)
    assert slots["freed"] == []
    assert slots["after"][0] == (2, [("cached", 108), ("cached", 109), ("accepted", 200),
                                     ("accepted", 201)])
    assert slots["after"][1][1][:2] == [("target", 999), ("rolled_back", 203)]
    sequence, spec = a_verification(4)  # all right: the bonus token lands after them
    slots = verification_slots(sequence, spec, 4)
    assert [k for k, _ in slots["after"][1][1]] == ["accepted", "accepted", "target", "empty"]


def test_a_bonus_token_past_the_table_is_drawn_as_waiting_for_its_block():
    sequence, spec = a_verification(4)
    spec = dict(spec, proposed=[200, 201, 202, 203, 204, 205], accepted=6,
                emitted=[200, 201, 202, 203, 204, 205, 206])  # 17 tokens: slot 16 has no block
    sequence = {"logical_blocks": [{"token_ids": (list(range(100, 110)) + spec["emitted"])[i:i + 4]}
                                   for i in range(0, 17, 4)]}
    spec["blocks_before"] = spec["blocks_after"] = [5, 9, 2, 7]
    root = ET.fromstring(render_verification(sequence, spec, 4))
    pending = with_class(root, "pending")
    assert len(pending) == 1 and pending[0].get("data-position") == "16"
    assert "then the target's bonus token" in "".join(root.itertext())


def test_a_finished_sequence_is_refused_with_a_clear_error():
    sequence, spec = a_verification(1)
    with pytest.raises(ValueError, match="finished"):
        render_verification(sequence, dict(spec, blocks_after=[]), 4)


def test_distribution_panels_share_one_scale_and_the_ticks_sit_at_p():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    root = ET.fromstring(render_distributions([("p", p), ("q", q)], ["a", "b", "c"],
                                              overlay={"q": p}, overlay_note="ticks: p"))
    bars = {(b.get("data-name"), int(b.get("data-token"))): b for b in with_class(root, "bar")}
    assert len(bars) == 6 and float(bars[("p", 0)].get("data-value")) == 0.5
    tallest = float(bars[("q", 2)].get("height"))
    assert float(bars[("p", 0)].get("height")) == pytest.approx(tallest * 0.5 / 0.6, abs=0.05)
    ticks = with_class(root, "overlay-tick")
    assert [float(t.get("data-value")) for t in ticks] == pytest.approx([0.5, 0.3, 0.2])
    assert float(root.get("width")) <= 800
    with pytest.raises(ValueError, match="same tokens"):
        render_distributions([("p", p), ("short", q[:2])])
