"""Words and code per lesson: the numbers the course's walls are judged by (README, "The
lessons"). For each lesson: the words of its text cells, its code cells, its longest code cell
in lines, and the code cells over ``--long`` lines (default 30) that are not a stub to answer
(a cell with ``not_done()``: the learner's class or function, docstrings included).

    python scripts/lesson_stats.py                    # every lesson in lessons/
    python scripts/lesson_stats.py --rev HEAD~20      # the lessons as they were at a commit
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def words(markdown: str) -> int:
    """Words a reader reads: code spans and markup left out, numbers counted."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    text = re.sub(r"`[^`]*`", " x ", text)  # a code span reads as one word
    text = re.sub(r"<[^>]+>|\]\([^)]*\)", " ", text)
    return len(re.findall(r"[A-Za-z0-9][\w'.-]*", text))


def stats(notebook, long_lines: int) -> dict:
    code = [c.source for c in notebook.cells if c.cell_type == "code"]
    lines = [len(s.splitlines()) for s in code]
    return {"words": sum(words(c.source) for c in notebook.cells if c.cell_type == "markdown"),
            "code cells": len(code), "longest": max(lines, default=0),
            "long cells": [i for i, c in enumerate(notebook.cells) if c.cell_type == "code"
                           and len(c.source.splitlines()) > long_lines
                           and "not_done()" not in c.source]}


def notebooks(rev: str | None) -> dict[str, object]:
    if rev is None:
        return {p.stem: nbformat.read(p, as_version=4)
                for p in sorted((ROOT / "lessons").glob("*.ipynb"))}
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "lessons/"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return {Path(n).stem: nbformat.reads(subprocess.run(
                ["git", "show", f"{rev}:{n}"], cwd=ROOT, capture_output=True, text=True,
                check=True).stdout, as_version=4)
            for n in sorted(names) if n.endswith(".ipynb")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="a git revision to read the lessons at (default: the "
                                      "working tree)")
    parser.add_argument("--long", type=int, default=30, help="lines that make a code cell long")
    args = parser.parse_args(argv)
    rows = {name: stats(nb, args.long) for name, nb in notebooks(args.rev).items()}
    print(f"{'lesson':28} {'words':>6} {'code':>5} {'longest':>8}  cells over {args.long} lines (not stubs)")
    for name, row in rows.items():
        print(f"{name:28} {row['words']:6} {row['code cells']:5} {row['longest']:8}  "
              f"{', '.join(map(str, row['long cells'])) or '-'}")
    print(f"{'all':28} {sum(r['words'] for r in rows.values()):6} "
          f"{sum(r['code cells'] for r in rows.values()):5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
