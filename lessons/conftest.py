"""Headless lesson runs (pytest --nbmake): unanswered code exercises use the solutions.

The kernel nbmake starts inherits this environment; in JupyterLab the variable is unset, so an
unanswered exercise says "not done yet" instead.
"""
import os

os.environ["MINIPAGED_SOLUTIONS"] = "1"
