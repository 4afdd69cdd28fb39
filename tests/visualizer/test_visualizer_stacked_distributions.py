"""Lesson 12's picture of rejection sampling: the residual is stacked on min(p, q), on the same
scale, so the two parts of a bar add up to the target p (the ticks)."""
import xml.etree.ElementTree as ET

import pytest
import torch

from minipaged.spec_decode.rejection_sampler import residual_distribution
from visualizer.distributions import render_distributions


def _values(root, cls, name):
    return [float(e.get("data-value")) for e in root.iter()
            if e.get("class") == cls and e.get("data-name") == name]


def test_accepted_plus_rejected_residual_is_p_bar_by_bar():
    p = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
    q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
    accepted = torch.minimum(p, q)
    rejected = (1 - accepted.sum()) * residual_distribution(p, q)
    root = ET.fromstring(render_distributions(
        [("p", p), ("parts", accepted)], stack={"parts": ("residual", rejected)},
        overlay={"parts": p}))
    lower, upper = _values(root, "bar", "parts"), _values(root, "stacked-bar", "residual")
    assert [round(a + b, 3) for a, b in zip(lower, upper)] == [round(v, 3) for v in p.tolist()]
    # drawn on p's scale: the stacked bar of the first token is as tall as p's own bar
    bars = {(e.get("data-name"), e.get("data-token")): e for e in root.iter()
            if e.get("class") in ("bar", "stacked-bar")}
    height = float(bars[("parts", "0")].get("height")) + float(bars[("residual", "0")].get("height"))
    assert height == pytest.approx(float(bars[("p", "0")].get("height")), abs=0.05)


def test_a_stack_on_no_panel_names_the_field():
    with pytest.raises(ValueError, match="stack"):
        render_distributions([("p", [0.5, 0.5])], stack={"q": ("r", [0.1, 0.1])})
