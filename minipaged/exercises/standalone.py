"""The saved copy of a build-track component: its source and what it needs from other cells.

A learner writes a component in one notebook cell, and its code uses names from other cells: a
lesson's import (lesson 10's ``apply_penalties``), a helper they wrote further up (lesson 12's
``residual_distribution``), a constant. ``standalone_source`` finds every such name (the names
the source reads but never binds, by Python's own scoping rules: ``symtable``), looks each up in
the learner's globals and writes what binds it again in a fresh namespace:

- a module, or an object a module has under its own name: an import line;
- a function or class the learner wrote in another cell: its source, and (transitively) what
  that source needs in turn, dependencies first;
- a plain value (numbers, strings, ``None``, and lists, tuples, dicts and sets of them): a
  literal.

Anything else (a lambda, a function made inside another function, an object built in a cell)
cannot be saved: ``CannotSave`` names it and says what to write instead. ``workbench`` uses this
when a component passes its check, lesson 02 onwards.
"""
from __future__ import annotations

import ast
import inspect
import linecache
import symtable
import sys
import textwrap
import types

# the most characters a plain value may take in the saved file (a table, not a data set)
MAX_LITERAL_CHARS = 20_000
_LITERAL_TYPES = (bool, int, float, complex, str, bytes, type(None), tuple, list, dict, set)


class CannotSave(ValueError):
    """A name the component uses cannot be written into its saved file (the message says why)."""


def learner_globals(obj) -> dict:
    """The globals a function or class was defined in (a notebook's: all its cells share them).

    Args:
        obj: the component, a function or a class.
    """
    target = obj.__func__ if inspect.ismethod(obj) else obj
    if inspect.isfunction(target):
        return target.__globals__
    if isinstance(target, type):
        for member in vars(target).values():
            function = _function_of(member)
            if function is not None and function.__qualname__.startswith(target.__qualname__):
                return function.__globals__
    module = sys.modules.get(getattr(target, "__module__", None) or "")
    return vars(module) if module is not None else {}


def source_of(obj) -> str:
    """The source of a class or function, also when it was defined in a notebook cell.

    ``inspect.getsource`` finds a class through its module's file, which a notebook does not
    have; the cell's text is in ``linecache`` under the file name its methods' code carries.

    Args:
        obj: a function, method or class.
    """
    target = obj.__func__ if inspect.ismethod(obj) else obj
    if inspect.isfunction(target):
        return inspect.getsource(target)
    code_objects = [function.__code__ for function in map(_function_of, vars(target).values())
                    if function is not None]
    if not code_objects:
        return inspect.getsource(target)
    filename = code_objects[0].co_filename
    text = "".join(linecache.getlines(filename))
    if not text:
        return inspect.getsource(target)
    first = min(code.co_firstlineno for code in code_objects)
    best = None
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.ClassDef) and node.name == target.__name__
                and node.lineno <= first <= (node.end_lineno or first)):
            if best is None or node.lineno > best.lineno:
                best = node  # the innermost class of that name around the methods
    if best is None:
        return inspect.getsource(target)
    start = min([best.lineno] + [d.lineno for d in best.decorator_list])
    return "".join(text.splitlines(keepends=True)[start - 1:best.end_lineno])


def free_names(source: str) -> list[str]:
    """The global names ``source`` reads and does not bind itself, sorted.

    Class bases, decorators, default values and annotations count (they run when the ``def`` or
    ``class`` statement runs), and so do the names read inside its functions; a function's
    parameters and locals, and attributes (``self.blocks``, ``torch.tensor``), do not.

    Args:
        source: module-level code, e.g. one ``def`` or ``class`` statement.
    """
    table = symtable.symtable(source, "<component>", "exec")
    bound_here = {s.get_name() for s in table.get_symbols()
                  if s.is_assigned() or s.is_imported()}
    found: set[str] = set()

    def visit(scope: symtable.SymbolTable) -> None:
        for symbol in scope.get_symbols():
            if not symbol.is_referenced():
                continue
            if scope.get_type() == "module" or symbol.is_global():
                found.add(symbol.get_name())
        for child in scope.get_children():
            visit(child)

    visit(table)
    return sorted(found - bound_here)


def standalone_source(obj, preamble: str = "") -> str:
    """``obj``'s source preceded by whatever binds the names it uses from elsewhere.

    Args:
        obj: the component (a function or a class) the learner wrote.
        preamble: code the saved file runs first (imports): a name it binds to the very object
            the learner's code uses needs no line of its own.

    Raises:
        CannotSave: a name cannot be written into the file (its message names it), or ``obj``
            has no source to keep.
    """
    name = getattr(obj, "__name__", None)
    if name == "<lambda>":
        raise CannotSave("it is a lambda: write it with `def` so that its source can be kept")
    try:
        source = textwrap.dedent(source_of(obj))
    except (OSError, TypeError) as error:
        raise CannotSave(f"its source cannot be found ({error}): write it in a notebook cell "
                         f"or a .py file") from None
    if name not in _top_level_names(source):
        raise CannotSave(f"its source (from line 1: {source.splitlines()[0].strip()!r}) does "
                         f"not define {name!r} at its top level")
    given: dict = {}
    try:
        exec(compile(preamble, "<preamble>", "exec"), given)  # imports only: cheap
    except Exception:  # noqa: BLE001 - then every name gets its own line; the copy's check
        given = {}     # reports what still fails
    writer = _Writer(given)
    writer.bound[name] = obj
    writer.need(source, learner_globals(obj), f"your {name}")
    return writer.render(source)


class _Writer:
    """Collects the import lines and the blocks (definitions, values) of one saved file."""

    def __init__(self, given: dict) -> None:
        self.given = given  # what the preamble binds already
        self.bound: dict[str, object] = {}  # name -> the object it stands for in the file
        self.imports: list[str] = []
        self.from_imports: dict[str, list[str]] = {}  # module -> ["name", "other as name"]
        self.blocks: list[str] = []  # in the order they must run: dependencies first

    def render(self, source: str) -> str:
        lines = list(self.imports)
        for module, names in self.from_imports.items():
            lines += _wrapped(f"from {module} import ", names)
        parts = ["\n".join(["# what your code uses from your other cells"] + lines)] \
            if lines else []
        parts += self.blocks
        parts.append(source.rstrip("\n"))
        return "\n\n\n".join(parts) + "\n"

    def need(self, source: str, namespace: dict, user: str) -> None:
        """Bind every free name of ``source`` (which runs in ``namespace``)."""
        for name in free_names(source):
            if name in namespace:  # else a builtin, or a name no cell defines: left as it is
                self.bind(name, namespace[name], namespace, user)

    def bind(self, name: str, value, namespace: dict, user: str) -> None:
        if name in self.bound:
            if self.bound[name] is not value:
                raise CannotSave(f"two different objects are named `{name}` in the code it "
                                 f"uses; rename one of them")
            return
        self.bound[name] = value
        if self.given.get(name, _ABSENT) is value:
            return  # the preamble's import is the same object
        found = _importable(value)
        if found is not None and "." not in found[1]:
            module, qualname = found
            self.from_imports.setdefault(module, []).append(
                name if qualname == name else f"{qualname} as {name}")
            return
        line = _import_line(name, value)
        if line is not None:
            self.imports.append(line)
            return
        if self._learners_definition(name, value, namespace):
            return
        literal = _literal(value)
        if literal is not None:
            self.blocks.append(f"{name} = {literal}")
            return
        for alias, module in _modules_in(namespace):
            for attribute, member in vars(module).items():
                if member is value and not attribute.startswith("__"):
                    self.bind(alias, module, namespace, user)
                    self.blocks.append(f"{name} = {alias}.{attribute}")
                    return
        raise CannotSave(_why_not(name, value, user))

    def _learners_definition(self, name: str, value, namespace: dict) -> bool:
        """Write a function or class of the learner's (from a cell), after what it needs."""
        if not (inspect.isfunction(value) or isinstance(value, type)):
            return False
        if _importable(value) is not None:
            return False
        qualname = value.__qualname__
        if value.__name__ == "<lambda>":
            raise CannotSave(f"`{name}` is a lambda (from another cell): the saved file keeps "
                             f"functions written with `def`; write `def {name}(...): return ...`")
        if "<locals>" in qualname:
            raise CannotSave(f"`{name}` was made inside another function "
                             f"({qualname.split('.<locals>')[0]}), whose variables the saved "
                             f"file cannot keep: define it at the top of a cell")
        owner, _, rest = qualname.partition(".")
        if rest:  # a method of a class of the learner's, e.g. `helper = MyClass.method`
            if namespace.get(owner) is None:
                raise CannotSave(f"`{name}` is {qualname}, but no cell defines `{owner}`")
            self.bind(owner, namespace[owner], namespace, f"your {name}")
            self.blocks.append(f"{name} = {qualname}")
            return True
        try:
            source = textwrap.dedent(source_of(value))
        except (OSError, TypeError):
            raise CannotSave(f"the source of `{name}` (from another cell) cannot be found: "
                             f"run its cell again") from None
        own = learner_globals(value) or namespace
        if value.__name__ != name:
            self.bind(value.__name__, value, own, f"your {name}")  # `name = other_name`
            self.blocks.append(f"{name} = {value.__name__}")
            return True
        self.need(source, own, f"your {name}")  # what it needs comes first
        self.blocks.append(source.rstrip("\n"))
        return True


_ABSENT = object()


def _wrapped(start: str, names: list[str], width: int = 100) -> list[str]:
    """``from module import a, b`` as one line, or one name a line when that is too long."""
    line = start + ", ".join(names)
    if len(line) <= width:
        return [line]
    return [start + "("] + [f"    {name}," for name in names] + [")"]


def _function_of(member):
    """The function behind a class attribute (method, static or class method, property)."""
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    elif isinstance(member, property):
        member = member.fget
    return member if inspect.isfunction(member) else None


def _top_level_names(source: str) -> set[str]:
    return {node.name for node in ast.parse(source).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _importable(value) -> tuple[str, str] | None:
    """(module, qualified name) when a fresh namespace can import ``value`` itself, else None."""
    module_name = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if (not isinstance(module_name, str) or not isinstance(qualname, str)
            or module_name == "__main__" or "<" in qualname):
        return None
    module = sys.modules.get(module_name)
    if module is None or getattr(module, "__spec__", None) is None:
        return None  # made by exec, or a notebook's own namespace
    target = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return (module_name, qualname) if target is value else None


def _import_line(name: str, value) -> str | None:
    """The import that binds ``name`` to ``value`` in a fresh namespace, or None."""
    if isinstance(value, types.ModuleType):
        module_name = getattr(value, "__name__", "")
        if (sys.modules.get(module_name) is not value or module_name == "__main__"
                or getattr(value, "__spec__", None) is None):
            return None
        if module_name == name:
            return f"import {name}"
        parent, _, leaf = module_name.rpartition(".")
        if parent and leaf == name:
            return f"from {parent} import {name}"
        return f"import {module_name} as {name}"
    found = _importable(value)
    if found is None:
        return None
    module_name, qualname = found
    if "." in qualname:  # e.g. a method: import its class under a name of its own
        owner, _, rest = qualname.partition(".")
        return f"from {module_name} import {owner} as _{owner}\n{name} = _{owner}.{rest}"
    return (f"from {module_name} import {name}" if qualname == name
            else f"from {module_name} import {qualname} as {name}")


def _literal(value) -> str | None:
    """``repr(value)`` when it reads back as an equal value of the same type, else None."""
    if not isinstance(value, _LITERAL_TYPES):
        return None
    if type(value) is set and not value:
        return "set()"  # ``{}`` would read back as a dict
    try:
        text = repr(value)
        if len(text) > MAX_LITERAL_CHARS:
            return None
        back = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return text if type(back) is type(value) and back == value else None


def _modules_in(namespace: dict):
    """(name, module) for the modules the learner's cells imported."""
    return [(alias, module) for alias, module in namespace.items()
            if isinstance(module, types.ModuleType) and not alias.startswith("_")
            and _import_line(alias, module) is not None]


def _why_not(name: str, value, user: str) -> str:
    kind = type(value).__name__
    if isinstance(value, _LITERAL_TYPES):
        what = f"a {kind} too large or too unusual to write as a literal"
    elif callable(value):
        what = f"a {kind}, made in a cell, that no module has under a name"
    else:
        what = f"a {kind} made in a cell"
    return (f"{user} uses `{name}` from another cell: {what}. The saved file keeps imports, "
            f"the functions and classes you wrote, and plain values (numbers, strings, lists, "
            f"...): build it inside your code, or make it a function of yours")
