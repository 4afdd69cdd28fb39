"""Where the repository is, for the tests that read its files or start processes in it.

One place for it, so that a test file can move between the folders of tests/ without its paths.
"""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/helpers/repo_paths.py -> the repository


def load_script(name: str):
    """The module of ``scripts/<name>.py`` (the scripts are no package: loaded by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
