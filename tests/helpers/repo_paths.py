"""Where the repository is, for the tests that read its files or start processes in it.

One place for it, so that a test file can move between the folders of tests/ without its paths.
"""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/helpers/repo_paths.py -> the repository
