"""The package's layers (docs/ARCHITECTURE.md): no import circles, and imports point downwards.

Every module of ``minipaged`` and ``visualizer`` is imported in a fresh interpreter (a module
that only works when something else was imported first fails here), and the import graph is read
from the sources (every ``import``, also those inside functions) and walked for cycles.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from repo_paths import ROOT

PACKAGES = ("minipaged", "visualizer")

# Who may import whom, by layer. A layer not named on the right of another's arrow is out of
# bounds for it. Data types (block, sequence, sampling_params, outputs, validation, config,
# cache_paths, model_shape, step_record) sit below everything; exercises, lab and the
# visualizer sit above everything. ``core`` (bookkeeping) and ``worker`` (tensors) sit side
# by side: neither imports the other, the scheduler's record of a step (``step_record.py``,
# plain data) goes between them.
LAYER_DEPS = {
    "types": set(),
    "core": {"types"},
    "kernels": {"types"},
    "models": {"types", "kernels"},
    "worker": {"types", "models", "kernels"},
    "spec_decode": {"types", "core", "worker", "models", "kernels"},
    "engine": {"types", "core", "worker", "spec_decode"},
    "entrypoints": {"types", "engine", "worker", "kernels"},
    "lab": {"types", "core", "engine", "worker", "models", "kernels", "spec_decode", "entrypoints"},
    "exercises": {"types", "core", "engine", "worker", "models", "kernels", "spec_decode",
                  "entrypoints", "lab"},
    "visualizer": {"types", "core", "engine", "worker", "models", "kernels", "spec_decode",
                   "entrypoints", "lab"},
    "api": {"types", "engine", "entrypoints"},  # minipaged/__init__.py, __main__.py
}
TYPES = {"block", "sequence", "sampling_params", "outputs", "validation", "config", "cache_paths",
         "child_process", "model_shape", "step_record", "speculative_config"}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "visualizer":
        return "visualizer"
    if len(parts) == 1 or parts[1] in ("__main__",):
        return "api"
    if parts[1] in TYPES:
        return "types"
    return parts[1]


def imports_of(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules ``module`` imports (resolved to modules, not names in them): every
    import, also those inside functions and under ``if TYPE_CHECKING:`` (an import for
    annotations only is still an edge of the graph, and may close a circle)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from a import b``: the module ``a.b`` if there is one, else a name in ``a``.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    # Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` too: those are edges as well,
    # but our ``__init__`` files import nothing (checked below), so they cannot close a circle.
    return found


@pytest.mark.slow  # (a fresh interpreter per module: 33 s on 2 cores)
def test_every_module_imports_alone_in_a_fresh_interpreter():
    names = [m for m in modules() if not m.endswith("__main__")]
    script = ("import importlib, sys\nbad = []\n"
              f"for name in {names!r}:\n"
              "    for loaded in [m for m in sys.modules if m.split('.')[0] in "
              f"{PACKAGES!r}]:\n"
              "        del sys.modules[loaded]\n"
              "    try:\n        importlib.import_module(name)\n"
              "    except Exception as exc:\n        bad.append(f'{name}: {exc!r}')\n"
              "print('\\n'.join(bad))\nsys.exit(1 if bad else 0)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_import_circles_anywhere():
    found = modules()
    graph = {m: imports_of(m, p, set(found)) for m, p in found.items()}
    # Depth-first search for a back edge; report the first circle found, as a path.
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    circles = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, no circles")


def test_imports_point_down_the_layers():
    found = modules()
    wrong = []
    for module, path in found.items():
        mine = layer(module)
        for target in imports_of(module, path, set(found)):
            theirs = layer(target)
            if theirs != mine and theirs not in LAYER_DEPS[mine]:
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_core_holds_no_tensors():
    """The bookkeeping layer is plain Python: no torch, so it reads (and tests) without one."""
    for module, path in modules().items():
        if layer(module) == "core":
            tree = ast.parse(path.read_text())
            names = {alias.name.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, (ast.Import, ast.ImportFrom))
                     for alias in (node.names if isinstance(node, ast.Import)
                                   else [ast.alias(node.module or "")])}
            assert not names & {"torch", "numpy"}, f"{module} imports {names & {'torch', 'numpy'}}"


def test_subpackage_inits_import_nothing():
    """``minipaged/<layer>/__init__.py`` is a docstring: importing one module of a layer never
    drags in the others (and so never closes a circle)."""
    for name in ("core", "engine", "worker", "models", "kernels", "entrypoints", "lab",
                 "spec_decode"):
        path = ROOT / "minipaged" / name / "__init__.py"
        tree = ast.parse(path.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                    and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")], path


def test_no_module_is_longer_than_about_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > 420}
    assert not long, f"split these (one idea per file): {long}"


def test_below_the_teaching_layers_only_these_modules_import_by_name():
    """An import by name (``importlib.import_module``) is invisible to the graph above, so each
    is listed: the optional Gemma package (worker/checkpoint.py), and the two places where the
    server reaches up on purpose, found at run time (docs/ARCHITECTURE.md): the live page's
    drawing (visualizer/live_page.py) and the learner's engine (exercises/served_learner.py,
    for ``serve --learner`` and ``LLM(learner=True)``)."""
    allowed = {"minipaged.worker.checkpoint", "minipaged.entrypoints.live_feed",
               "minipaged.entrypoints.cli", "minipaged.entrypoints.llm"}
    found = set()
    for module, path in modules().items():
        if layer(module) in ("lab", "exercises", "visualizer"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
                found.add(module)
    assert found == allowed, sorted(found ^ allowed)
