"""Text that stays inside an SVG drawing and never overlaps other text (the visualizers).

Every <text> gets a box from its font size and length (monospace: 0.6 em per character, 1 em
high) and its anchor; no box may leave the viewBox, and no two boxes may overlap.
"""
import xml.etree.ElementTree as ET

NS = "{http://www.w3.org/2000/svg}"
CHAR_W, ASCENT, DESCENT = 0.6, 0.8, 0.2


def text_boxes(svg: str):
    root = ET.fromstring(svg)
    _, _, width, height = map(float, root.get("viewBox").split())
    boxes = []
    for node in root.iter(NS + "text"):
        content = "".join(node.itertext())
        if not content:
            continue
        size = float(node.get("font-size", 11))
        x, y = float(node.get("x")), float(node.get("y"))
        w = CHAR_W * size * len(content)
        anchor = node.get("text-anchor", "start")
        x0 = x - (w if anchor == "end" else w / 2 if anchor == "middle" else 0)
        boxes.append((content, x0, y - ASCENT * size, x0 + w, y + DESCENT * size))
    return boxes, width, height


def assert_clean_layout(svg: str, what: str) -> None:
    boxes, width, height = text_boxes(svg)
    for content, x0, y0, x1, y1 in boxes:
        assert x0 >= -0.5 and y0 >= -0.5 and x1 <= width + 0.5 and y1 <= height + 0.5, \
            f"{what}: {content!r} leaves the {width}x{height} viewBox: ({x0:.0f},{y0:.0f})-({x1:.0f},{y1:.0f})"
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            overlap_x = min(a[3], b[3]) - max(a[1], b[1])
            overlap_y = min(a[4], b[4]) - max(a[2], b[2])
            assert overlap_x <= 0.5 or overlap_y <= 0.5, f"{what}: {a[0]!r} overlaps {b[0]!r}"
