"""Predict, then measure: the learner's guesses before the cells that measure, and their record
(lessons 01-18; lesson 16 shows the record).

A lesson asks for a number before the cell that measures it::

    my_prediction = None  # <- your guess: blocks the two sequences hold after the fork

and the measuring cell answers with both::

    compare("03", "blocks held after a fork", my_prediction, measured, unit="blocks",
            why="a fork copies the table, not the blocks: only the ref counts change")

``compare`` prints the prediction next to the measurement with a sentence on what the gap means,
and keeps the pair in the learner's folder (``predictions.json`` beside the saved components,
``workbench.learner_dir()``), newest last. An unanswered prediction (None) is not an error: the
cell prints the measurement and keeps nothing. ``record()`` reads the whole record back; lesson
16 draws it as a table, the wrong guesses first.
"""
from __future__ import annotations

import datetime
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

FILE_NAME = "predictions.json"
CLOSE = 0.10  # a prediction within this fraction of the measurement counts as right


@dataclass
class Prediction:
    """One guess and what was measured (plain data, as kept in the file)."""

    lesson: str
    question: str
    predicted: float
    measured: float
    unit: str
    when: str

    @property
    def off_by(self) -> float:
        """How far off, as a fraction of the measurement (0 when both are 0)."""
        if self.measured == 0:
            return 0.0 if self.predicted == 0 else math.inf
        return abs(self.predicted - self.measured) / abs(self.measured)

    @property
    def right(self) -> bool:
        return self.off_by <= CLOSE


def _path() -> Path:
    from minipaged.exercises.workbench import learner_dir

    return learner_dir() / FILE_NAME


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{what} must be a number (an int or a float), got {value!r}")
    return float(value)


def _shown(value: float, unit: str = "") -> str:
    """``value`` with its unit, singular for exactly 1 ("1 preemption", "3 preemptions")."""
    number = f"{value:,.0f}" if float(value).is_integer() else f"{value:,.3g}"
    if not unit:
        return number
    if value == 1 and unit.endswith("s") and not unit.endswith("ss"):
        unit = unit[:-1]
    return f"{number}{unit}" if unit.startswith("%") else f"{number} {unit}"


def compare(lesson: str, question: str, predicted, measured, unit: str = "",
            why: str = "", keep: bool = True) -> Prediction | None:
    """Print ``predicted`` next to ``measured`` and keep both in the learner's record.

    Args:
        lesson: the lesson's number ("03").
        question: what was predicted, in a few words ("blocks held after a fork").
        predicted: the learner's number, or None when they made no prediction.
        measured: what the cell measured.
        unit: the unit, for the sentence ("blocks", "ms").
        why: what the measurement depends on, said when the guess is off.
        keep: write the pair to the record (tests turn it off).

    Returns the kept ``Prediction``, or None when there was no prediction.
    """
    measured = _number(measured, "the measurement")
    if predicted is None:
        print(f"measured: {_shown(measured, unit)} ({question}). Set my_prediction "
              f"before this cell next time: a guess written down first is what shows you "
              f"what you expected.")
        return None
    predicted = _number(predicted, "my_prediction")
    entry = Prediction(lesson, question, predicted, measured, unit,
                       datetime.datetime.now().isoformat(timespec="seconds"))
    line = (f"you predicted {_shown(predicted, unit)}, measured {_shown(measured, unit)} "
            f"({question}): ")
    if entry.right:
        line += "right" + (" (within 10 %)" if predicted != measured else "") + \
            ": your picture of it holds."
    else:
        direction = "high" if predicted > measured else "low"
        times = (predicted / measured if predicted > measured else measured / predicted) \
            if predicted and measured else math.inf
        size = f"{times:.1f}x too {direction}" if math.isfinite(times) else f"too {direction}"
        line += f"{size}. {why}".rstrip()
    print(line)
    if keep:
        kept = record()
        kept.append(entry)
        path = _path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([asdict(p) for p in kept], indent=1))
        tmp.replace(path)
    return entry


def record() -> list[Prediction]:
    """Every prediction kept so far, oldest first ([] when none, or the file is unreadable)."""
    try:
        rows = json.loads(_path().read_text())
        return [Prediction(**row) for row in rows]
    except (OSError, ValueError, TypeError):
        return []


def summary(rows: list[Prediction] | None = None) -> str:
    """The record as a table (Markdown), the wrong guesses first, and one line of totals."""
    rows = record() if rows is None else rows
    if not rows:
        return ("No predictions kept yet: the lessons ask for one before some measurements "
                "(my_prediction = ...), and the record fills as you answer them.")
    latest = {}
    for row in rows:  # a question answered again: its newest answer counts
        latest[(row.lesson, row.question)] = row
    ordered = sorted(latest.values(), key=lambda r: (r.right, r.lesson))
    lines = ["| lesson | question | you predicted | measured | off by |",
             "|---|---|---:|---:|---:|"]
    for r in ordered:
        off = "right" if r.right else (f"{r.off_by:.0%}" if math.isfinite(r.off_by) else "-")
        lines.append(f"| {r.lesson} | {r.question} | {_shown(r.predicted, r.unit)} | "
                     f"{_shown(r.measured, r.unit)} | {off} |")
    right = sum(r.right for r in ordered)
    lines.append("")
    lines.append(f"{right} of {len(ordered)} predictions within 10 % of the measurement.")
    return "\n".join(lines)
