"""Nothing of a build-track component is listed before its stub asks for it.

The build track's components (``workbench.register(Component(...))`` in
``minipaged/exercises/lesson*.py``) are the package's own classes and functions, written by the
learner from a stub: the code cell tagged ``metadata.minipaged.component``. A lesson may list the
package's version only after that cell (next to the learner's, once it passed); before it, it
teaches with the neighbours' listings, pictures and numbers.

The scan is static: every lesson's code cells, in course order (lesson 01 cell 0 first), are
parsed; names are resolved through the lesson's own imports and simple assignments; every call
of a listing helper (``show_source`` however it is imported, ``source_part``, ``show_file_part``,
``file_part``, ``inspect.getsource``/``getsourcelines``) is a listing. A listing before a
component's stub fails when it lists the component's package object, a method the stub asks for,
a class or module holding them whole, or text that repeats a good part of the package's source
(which catches parts of a file, such as the CUDA kernel's phase 3).
"""
from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import types
from dataclasses import dataclass

import pytest

from repo_paths import ROOT

LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))

# listing helpers: what they list is their first argument (an object, or a repository file)
_OBJECT_LISTERS = ("visualizer.source:show_source", "visualizer.source:source_part",
                   "inspect:getsource", "inspect:getsourcelines")
_FILE_LISTERS = ("visualizer.source:show_file_part", "visualizer.source:file_part")
# components whose package version is a stretch of a file rather than an object
_TEXT_COMPONENTS = {
    "softmax_phase_cuda": "minipaged.lab.kernel_exercise:package_phase3",
}
# a listing repeats a component when it holds this many of the component's lines (or half)
_SHARED_LINES = 5


def _resolve(path: str):
    module, _, attribute = path.partition(":")
    target = importlib.import_module(module)
    for part in filter(None, attribute.split(".")):
        target = getattr(target, part)
    return target


def _lister_kind(obj) -> str | None:
    for kind, paths in (("object", _OBJECT_LISTERS), ("file", _FILE_LISTERS)):
        if any(obj is _resolve(path) for path in paths):
            return kind
    return None


def _significant(text: str) -> set[str]:
    """The lines of ``text`` that say something (blank lines, brackets and short lines like
    ``return out`` are shared by any two listings)."""
    return {line.strip() for line in text.splitlines() if len(line.strip()) >= 16}


# -- the components -----------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    lesson: int
    stub_cell: int
    objects: list  # the package's objects a listing must not show
    text: str  # their source, for listings of parts


def _stub_cells() -> dict[str, tuple[int, int, str]]:
    """component name -> (lesson number, cell index, the cell's source) of its stub."""
    stubs = {}
    for path in LESSONS:
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            name = cell.get("metadata", {}).get("minipaged", {}).get("component")
            if name:
                stubs[name] = (int(path.name[:2]), index, "".join(cell["source"]))
    return stubs


def _untagged_stub(spec) -> tuple[int, int, str] | None:
    """The first code cell of the component's lesson that runs its check (for a stub cell that
    is not tagged): ``check_component("<name>"`` or the checker's public name."""
    path = next(p for p in LESSONS if p.name.startswith(spec.lesson))
    calls = (f'check_component("{spec.name}"', spec.check.__name__.lstrip("_") + "(")
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and any(call in source for call in calls):
            return int(spec.lesson), index, source
    return None


def _asked_methods(stub_source: str) -> list[str] | None:
    """The methods a stub's class defines (None when the stub is not a class)."""
    for node in ast.parse(stub_source).body:
        if isinstance(node, ast.ClassDef):
            return [n.name for n in node.body
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return None


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def component_targets() -> list[Target]:
    from minipaged.exercises import workbench

    stubs = _stub_cells()
    targets = []
    for name, spec in sorted(workbench.components().items()):
        found = stubs.get(name) or _untagged_stub(spec)
        assert found, f"component {name!r} has no stub cell in lesson {spec.lesson}"
        lesson, cell, stub = found
        objects = []
        for slot in spec.slots:
            obj = workbench._resolve(slot)
            if obj is None or isinstance(obj, str):
                continue  # not an object: its text is in _TEXT_COMPONENTS
            methods = _asked_methods(stub) if isinstance(obj, type) else None
            if methods is None:
                objects.append(obj)
            else:  # a class: only the methods the stub asks for are the learner's
                objects.append(obj)
                objects += [getattr(obj, m) for m in methods if hasattr(obj, m)]
        unique = list({id(o): o for o in objects}.values())
        if name in _TEXT_COMPONENTS:
            text = _resolve(_TEXT_COMPONENTS[name])()
        else:
            assert unique, (f"component {name!r}: none of its slots is an object; name where its "
                            f"package version is in _TEXT_COMPONENTS")
            text = "\n".join(_source(o) for o in unique if not isinstance(o, type))
            if not text:  # a class stub that asks for no method: the whole class
                text = "\n".join(_source(o) for o in unique)
        targets.append(Target(name, lesson, cell, unique, text))
    return targets


# The exercises that are not components, each with the package objects it asks the learner to
# write again (issue 55: lesson 10 listed top_k_top_p_filter before exercise 1 asks for its
# top-p rule, lesson 11 block_hash before its exercise, and apply_penalties before the sampler)
WARM_UPS = {
    ("10", "top_p_filter"): ["minipaged.worker.sampler:top_k_top_p_filter"],
    ("10", "MySampler"): ["minipaged.worker.sampler:apply_penalties"],
    ("11", "my_block_hash"): ["minipaged.core.prefix_caching_allocator:block_hash"],
    ("11", "cached_tokens"): ["minipaged.core.prefix_caching_allocator:"
                              "PrefixCachingAllocator.longest_cached_prefix"],
}


def warm_up_targets() -> list[Target]:
    """``WARM_UPS`` as targets: the cell that defines the exercise's function or class is its
    stub."""
    targets = []
    for (lesson, name), paths in WARM_UPS.items():
        (path,) = [p for p in LESSONS if p.name.startswith(lesson)]
        cells = json.loads(path.read_text())["cells"]
        cell = next(i for i, c in enumerate(cells) if c["cell_type"] == "code" and re.search(
            rf"^(def|class) {name}\b", "".join(c["source"]), re.M))
        objects = [_resolve(p) for p in paths]
        targets.append(Target(name, int(lesson), cell, objects,
                              "\n".join(_source(o) for o in objects)))
    return targets


# -- the listings -------------------------------------------------------------------------------
@dataclass
class Listing:
    lesson: int
    cell: int
    code: str  # the call, as written
    obj: object  # what is listed (None for a file part)
    text: str  # the listed source
    whole: str = ""  # the whole object or file the part is cut from
    markers: tuple = ()  # the start and end markers the call names (literal strings)


class _Names:
    """What a lesson's names stand for, from its imports and simple assignments, in cell order.
    Values are resolved lazily (only for names a listing uses)."""

    def __init__(self):
        self.paths: dict[str, str] = {}  # name -> "module:attribute" or "module:"
        self.values: dict[str, object] = {}  # name -> an object or a literal

    def learn(self, tree: ast.AST) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.paths[alias.asname] = alias.name + ":"
                    else:
                        top = alias.name.split(".")[0]
                        self.paths[top] = top + ":"
                    self.values.pop(alias.asname or alias.name.split(".")[0], None)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    local = alias.asname or alias.name
                    self.paths[local] = f"{node.module}:{alias.name}"
                    self.values.pop(local, None)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                local = node.targets[0].id
                try:
                    self.values[local] = ast.literal_eval(node.value)
                    self.paths.pop(local, None)
                    continue
                except ValueError:
                    pass
                obj = self.evaluate(node.value)
                if obj is not None:
                    self.values[local] = obj
                    self.paths.pop(local, None)

    def lookup(self, name: str):
        if name in self.values:
            return self.values[name]
        path = self.paths.get(name)
        if path is None:
            return None
        module, _, attribute = path.partition(":")
        try:
            if not attribute:
                value = importlib.import_module(module)
            else:
                try:
                    value = getattr(importlib.import_module(module), attribute)
                except AttributeError:
                    value = importlib.import_module(f"{module}.{attribute}")
        except ImportError:
            return None
        self.values[name] = value
        return value

    def evaluate(self, node: ast.AST):
        """The object a name or a chain of attributes stands for, or None."""
        if isinstance(node, ast.Name):
            return self.lookup(node.id)
        if isinstance(node, ast.Attribute):
            owner = self.evaluate(node.value)
            return None if owner is None else getattr(owner, node.attr, None)
        if isinstance(node, ast.Constant):
            return node.value
        return None


def _argument(call: ast.Call, position: int, keyword: str, names: _Names):
    for kw in call.keywords:
        if kw.arg == keyword:
            return names.evaluate(kw.value)
    return names.evaluate(call.args[position]) if len(call.args) > position else None


def _object_text(obj, start, end) -> str:
    from visualizer.source import source_part

    try:
        return source_part(obj, start if isinstance(start, str) else None,
                           end if isinstance(end, str) else None)
    except ValueError:  # a marker that is not there: show_source lists the whole object
        return _source(obj)
    except (OSError, TypeError):
        return ""


def lesson_listings(cells: list[dict], lesson: int) -> list[Listing]:
    names = _Names()
    found = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        # IPython magics and shell lines are not Python
        source = "\n".join("" if re.match(r"\s*[%!]", line) else line
                           for line in source.splitlines())
        tree = ast.parse(source)
        names.learn(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            helper = names.evaluate(node.func)
            kind = _lister_kind(helper) if callable(helper) else None
            if kind is None:
                continue
            what = names.evaluate(node.args[0])
            start = _argument(node, 1, "start", names)
            end = _argument(node, 2, "end", names)
            code = ast.get_source_segment(source, node)
            markers = tuple(m for m in (start, end) if isinstance(m, str))
            if kind == "file":
                from visualizer.source import REPO_ROOT, file_part

                if isinstance(what, str):
                    text = file_part(what, start, end)
                    whole = (REPO_ROOT / what).read_text()
                else:
                    text = whole = ""
                found.append(Listing(lesson, index, code, None, text, whole, markers))
            elif what is not None:
                found.append(Listing(lesson, index, code, what, _object_text(what, start, end),
                                     _source(what), markers))
            else:
                found.append(Listing(lesson, index, code, None, ""))  # unknown: no text to judge
    return found


def _unwrap(obj):
    return obj.__func__ if isinstance(obj, (types.MethodType, classmethod, staticmethod)) else obj


def _holds(container, obj) -> bool:
    """Is ``obj`` defined inside the class or module ``container``?"""
    obj = _unwrap(obj)
    if isinstance(container, types.ModuleType):
        return getattr(obj, "__module__", None) == container.__name__
    if isinstance(container, type):
        qualname = getattr(obj, "__qualname__", "")
        return (getattr(obj, "__module__", None) == container.__module__
                and qualname.startswith(container.__qualname__ + "."))
    return False


def spoils(listing: Listing, target: Target) -> str | None:
    """Why ``listing`` gives ``target`` away (None when it does not)."""
    if listing.obj is not None:
        listed = _unwrap(listing.obj)
        for obj in target.objects:
            if listed is _unwrap(obj):
                return f"lists {target.name}'s package object"
            if _holds(listed, obj) and not isinstance(obj, type):
                holder = getattr(listed, "__name__", listed)
                return f"lists {holder}, which holds {target.name} whole"
    ours, listed = _significant(target.text), _significant(listing.text)
    shared = ours & listed
    if ours and len(shared) >= min(_SHARED_LINES, max(1, len(ours) // 2)):
        return f"repeats {len(shared)} of the {len(ours)} lines of {target.name}'s package source"
    return None


def spoilers(notebooks: dict[int, list[dict]], targets: list[Target]) -> list[str]:
    problems = []
    for lesson, cells in sorted(notebooks.items()):
        for listing in lesson_listings(cells, lesson):
            for target in targets:
                if (listing.lesson, listing.cell) >= (target.lesson, target.stub_cell):
                    continue  # after the stub: the learner has written it
                why = spoils(listing, target)
                if why:
                    problems.append(f"lesson {lesson:02d} cell {listing.cell}: `{listing.code}` "
                                    f"{why}, before its stub (lesson {target.lesson:02d} cell "
                                    f"{target.stub_cell})")
    return problems


def _notebooks() -> dict[int, list[dict]]:
    return {int(p.name[:2]): json.loads(p.read_text())["cells"] for p in LESSONS}


@pytest.fixture(scope="module")
def targets():
    return component_targets()


def test_every_component_has_a_stub_and_a_package_source(targets):
    assert len(targets) >= 12
    for target in targets:
        assert target.text.strip(), f"no package source found for {target.name}"


def test_no_lesson_lists_a_component_before_its_stub(targets):
    problems = spoilers(_notebooks(), targets)
    assert not problems, "\n".join(problems)


def test_no_lesson_lists_what_an_exercise_asks_for_before_it():
    problems = spoilers(_notebooks(), warm_up_targets())
    assert not problems, "\n".join(problems)
    notebooks = _notebooks()  # the listing the issue found, put back, is caught
    (cell,) = [i for i, c in enumerate(notebooks[10]) if "## 3. Top-k and top-p" in
               "".join(c["source"])]
    notebooks[10].insert(cell + 1, _code("show(top_k_top_p_filter)"))
    targets = [Target(t.name, t.lesson, t.stub_cell + (t.lesson == 10), t.objects, t.text)
               for t in warm_up_targets()]
    assert [p for p in spoilers(notebooks, targets) if "top_p_filter" in p]


def missing_markers(notebooks: dict[int, list[dict]]) -> list[str]:
    missing = []
    for lesson, cells in sorted(notebooks.items()):
        for listing in lesson_listings(cells, lesson):
            for marker in listing.markers:
                if listing.whole and marker not in listing.whole:
                    missing.append(f"lesson {lesson:02d} cell {listing.cell}: `{listing.code}`: "
                                   f"{marker!r} is not in what it lists")
    return missing


def test_every_listing_marker_is_in_what_it_lists():
    """A ``start``/``end`` marker that is no longer in the source makes ``show_source`` list the
    whole object (or a file part run to the end of the file): the lesson then shows what its
    text does not say."""
    missing = missing_markers(_notebooks())
    assert not missing, "\n".join(missing)


def test_a_marker_that_is_gone_is_caught():
    cells = _notebooks()[8]
    cells = cells[:2] + [_code('show(apply_step, end="no such line")')] + cells[2:]
    assert [m for m in missing_markers({8: cells}) if "'no such line'" in m]


def _code(source: str) -> dict:
    return {"cell_type": "code", "metadata": {}, "source": source, "outputs": [],
            "execution_count": None}


@pytest.mark.parametrize("lesson, cell", [
    # the listing of lesson 12 before its first stub
    (12, "show(rejection_sampler.greedy_verify)"),
    # another name for it, imported in the cell itself
    (12, "from minipaged.spec_decode.rejection_sampler import greedy_verify as gv\n"
         "import visualizer.source as vs\nvs.show_source(gv)"),
    # a part of a method the stub asks for, through inspect
    (3, "import inspect\nprint(inspect.getsource(BlockSpaceManager.fork))"),
    # the class holding a stub's method whole (lesson 09 asks for one method of Scheduler)
    (8, "show(Scheduler)"),
    # the module that holds step() whole, in an earlier lesson
    (13, "import minipaged.engine.llm_engine as engine_module\nshow(engine_module)"),
    # the CUDA phase 3 as a part of the kernel file, named through a constant
    (6, 'KERNEL = "csrc/paged_attention.cu"\nshow_file_part(KERNEL, "// >>> softmax_phase")'),
])
def test_a_listing_put_before_a_stub_is_caught(targets, lesson, cell):
    notebooks = _notebooks()
    cells = notebooks[lesson]
    # right after the imports of the lesson's first code cell
    first = next(i for i, c in enumerate(cells) if c["cell_type"] == "code")
    notebooks[lesson] = cells[:first + 1] + [_code(cell)] + cells[first + 1:]
    shifted = [Target(t.name, t.lesson, t.stub_cell + (t.lesson == lesson), t.objects, t.text)
               for t in targets]
    problems = spoilers(notebooks, shifted)
    assert any(p.startswith(f"lesson {lesson:02d} cell {first + 1}:") for p in problems), problems


def test_a_listing_after_the_stub_is_allowed(targets):
    notebooks = {12: _notebooks()[12]}
    cells = notebooks[12]
    stub = next(t for t in targets if t.name == "greedy_verify").stub_cell
    notebooks[12] = cells[:stub + 1] + [_code("show(rejection_sampler.greedy_verify)")] \
        + cells[stub + 1:]
    assert not [p for p in spoilers(notebooks, targets) if "greedy_verify" in p and
                f"cell {stub + 1}:" in p]
