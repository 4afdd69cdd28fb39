"""A tiny SVG builder on top of xml.etree, shared by every renderer.

Building the drawing as an element tree (not by pasting strings) keeps the output valid XML, so
the tests can parse it and Jupyter, GitHub and nbviewer can show it.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET

SVG_NS = "http://www.w3.org/2000/svg"

# One colour per sequence (colour-blind-friendly "Tableau 10"), cycled when there are more.
# NOTE: without Tableau's red, pink and grey (indigo, olive green and light blue instead): red is
# HIGHLIGHT, which marks events (a copy-on-write copy, the newest token, a preemption), and grey
# is a free or evictable block; a sequence drawn in either would read as one of those.
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#7b66d2", "#76b7b2",
           "#edc948", "#b07aa1", "#a5b84c", "#9c755f", "#a0cbe8"]
FREE_FILL = "#f4f4f4"
INK = "#333333"
MUTED = "#888888"
HIGHLIGHT = "#d62728"
FONT = "font-family:DejaVu Sans Mono,Menlo,Consolas,monospace"


def colour(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def _attr_name(name: str) -> str:
    # class_ -> class, data_block -> data-block, stroke_width -> stroke-width
    return name.rstrip("_").replace("_", "-")


def _attr_value(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:.2f}".rstrip("0").rstrip(".")
    return str(value)


def el(parent: ET.Element, tag: str, text: str | None = None, **attrs) -> ET.Element:
    """Append <tag attrs>text</tag> to ``parent``; None-valued attributes are left out."""
    node = ET.SubElement(parent, tag, {_attr_name(k): _attr_value(v)
                                       for k, v in attrs.items() if v is not None})
    if text is not None:
        node.text = str(text)
    return node


def svg_root(width: float, height: float, class_: str, **attrs) -> ET.Element:
    root = ET.Element("svg", {"xmlns": SVG_NS, "version": "1.1",
                              "width": _attr_value(width), "height": _attr_value(height),
                              "viewBox": f"0 0 {_attr_value(width)} {_attr_value(height)}",
                              "class": class_, "style": FONT})
    for k, v in attrs.items():
        if v is not None:
            root.set(_attr_name(k), _attr_value(v))
    el(root, "rect", x=0, y=0, width=width, height=height, fill="white", class_="background")
    return root


def caption(root: ET.Element, x: float, y: float, title: str) -> ET.Element:
    """The drawing's title at (x, y), bold; the drawing widens when the title is longer than it
    (an SVG shown in JupyterLab clips what lies past its width)."""
    node = text(root, x, y, title, size=13, weight="bold", class_="caption")
    needed = x + text_width(title, 13) + 10
    if needed > float(root.get("width")):
        height = root.get("height")
        root.set("width", _attr_value(needed))
        root.set("viewBox", f"0 0 {_attr_value(needed)} {height}")
        root.find("rect").set("width", _attr_value(needed))
    return node


def text_width(content, size: float) -> float:
    """About how wide ``content`` is in the drawings' monospace font (0.6 em per character)."""
    return 0.6 * size * len(str(content))


def text(parent, x, y, content, size=11, anchor="start", fill=INK, weight=None, **attrs):
    return el(parent, "text", content, x=x, y=y, font_size=size, text_anchor=anchor, fill=fill,
              font_weight=weight, **attrs)


def shorten(label, max_chars: int) -> str:
    """``label`` cut to ``max_chars`` characters, ending in "…" when cut (a server's request ids
    are 40 characters long; a drawing has room for the first few)."""
    label = str(label)
    return label if len(label) <= max_chars else label[:max(max_chars - 1, 1)] + "…"


def to_string(root: ET.Element) -> str:
    return ET.tostring(root, encoding="unicode")
