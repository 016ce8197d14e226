"""Every lab's rule, "your code keeps to its own objects", read from the learner's source in the grader.

The sandbox runs the learner's definitions in the same interpreter as the checks, so code that reaches
around its own names (a stack frame's locals, an import of the grader, a module's attribute rebound)
could rewrite what a check observes there. The grader reads the graded definitions before any sandbox
starts, where the learner's code never runs, and refuses such reaching with the line named: imports from
the standard modules a lab needs, torch, triton, numpy and kvlib only, never ``kvlib.course`` (the
course's graders and answers); no dunder attribute but ``__init__``-like ones; no frame, traceback or
generator internals; no builtin that looks a name up by string or runs text as code; no private name of
an imported module or class; nothing assigned or deleted through an imported name or ``type(x)``. A
breach scores the task 0 and is flagged for the instructor. Honest code needs none of these.

It is a fence, not a proof: whatever a check still measures inside the sandbox, a determined learner may
find another way around; the checks that send decisions (``decisions.py``) need no fence.
"""
from __future__ import annotations

import ast
import inspect
import re
import textwrap

from kvlib.course.grading.extract import Statement

ALLOWED_MODULES = {"__future__", "abc", "array", "bisect", "collections", "contextlib", "copy", "dataclasses",
                   "decimal", "enum", "fractions", "functools", "heapq", "itertools", "math", "numbers", "random", "re",
                   "statistics", "string", "time", "typing", "numpy", "torch", "triton", "kvlib"}
FORBIDDEN_MODULES = ("kvlib.course", "torch.utils", "torch.hub", "torch.library", "torch.ops", "torch.jit",
                     "torch.overrides", "triton.runtime", "triton.compiler", "triton.backends", "numpy.ctypeslib")
REACHING_NAMES = {"getattr", "setattr", "delattr", "vars", "globals", "locals", "eval", "exec", "compile", "open",
                  "breakpoint", "input", "exit", "quit", "get_type_hints", "ForwardRef"}
REACHING_ATTRIBUTES = {  # frames, tracebacks, generators, and the modules that lead to every other module
    "tb_frame", "tb_next", "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "f_trace", "gi_frame",
    "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "cr_await", "ag_frame", "ag_code", "cell_contents",
    "sys", "os", "gc", "builtins", "importlib", "inspect", "ctypes", "ctypeslib", "modules", "course", "grading",
    "get_type_hints", "ForwardRef"}
DUNDERS_ALLOWED = {"__init__", "__post_init__", "__name__", "__qualname__", "__doc__"}
DUNDERS_NOT_DEFINED = {"__torch_function__", "__torch_dispatch__", "__instancecheck__", "__subclasscheck__"}


def reaches(statements) -> list[str]:
    """Where the graded definitions reach outside their own objects: one line each, naming the cell and line."""
    found: list[str] = []
    trees = [(statement, ast.parse(statement.source)) for statement in statements]
    imported = {(alias.asname or alias.name).split(".")[0] for _, tree in trees for node in ast.walk(tree)  # every
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}  # cell's: one namespace
    for statement, tree in trees:
        for node, offset in _nodes(tree):
            found += [f"{where(statement, node, offset)}: {why}" for why in _breaches(node, imported)]
    return in_line_order(found)


def in_line_order(found: list[str]) -> list[str]:
    """Breaches once each, by cell and line (each begins with :func:`where`'s text)."""
    return sorted(set(found), key=lambda text: [int(n) for n in re.findall(r"\d+", text.split(":")[0])])


def where(statement, node: ast.AST, offset: int = 0) -> str:
    """The cell and line of ``node`` in the notebook (``offset``: the line of the string annotation it came from)."""
    line = statement.first_line + offset + getattr(node, "lineno", 1) - 1
    return f"code cell {statement.cell}, line {line}" if statement.cell else f"line {line} of your code"


def source_of(function) -> list:
    """The feedback's statements: ``function``'s own source where Python can find it (cells in Jupyter do)."""
    try:
        return [Statement(0, function.__code__.co_firstlineno, textwrap.dedent(inspect.getsource(function)))]
    except (AttributeError, OSError, TypeError):
        return []


def _nodes(tree: ast.AST):
    """Every node, and those of annotations written as strings (``get_type_hints`` would run them)."""
    for node in ast.walk(tree):
        yield node, 0
        for annotation in (getattr(node, "annotation", None), getattr(node, "returns", None)):
            if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
                try:
                    inner = ast.parse(annotation.value, mode="eval")
                except SyntaxError:
                    continue
                yield from ((n, annotation.lineno - 1) for n in ast.walk(inner))


def _breaches(node: ast.AST, imported: set[str]) -> list[str]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
        return [f"imports {m}; graded code may import {', '.join(sorted(ALLOWED_MODULES - {'__future__'}))}, "
                f"never kvlib.course" for m in modules if not importable(m)]
    if isinstance(node, ast.Name) and (node.id in REACHING_NAMES or _dunder(node.id) and node.id != "__name__"
                                       and not isinstance(node.ctx, ast.Store)):  # defining __slots__ is fine
        return [f"uses {node.id}, which reaches objects by name or runs text as code; use your own names"]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in DUNDERS_NOT_DEFINED:
        return [f"defines {node.name}, which would change how the grader's own calls behave"]
    if isinstance(node, ast.Attribute):
        if node.attr in REACHING_ATTRIBUTES or _dunder(node.attr) and node.attr not in DUNDERS_ALLOWED:
            return [f"reads .{node.attr}, which reaches past your own objects (frames, modules, internals)"]
        root, chain = _root(node)
        if root in imported and any(part.startswith("_") for part in chain):
            return [f"reads {root}.{'.'.join(chain)}, a private name of what you imported"]
    return [f"changes {ast.unparse(t)}, reached through {_root(t)[0]}: graded code may change only its own objects"
            for t in _targets(node) if _root(t)[0] in imported | {"type"}]  # type(x).f = ...: x's class, not yours


def importable(module: str) -> bool:
    """Whether every lab lets graded code import ``module`` (a lab's own rule may allow less)."""
    return module.split(".")[0] in ALLOWED_MODULES and not any(
        module == f or module.startswith(f + ".") for f in FORBIDDEN_MODULES) and not any(
        part.startswith("_") for part in module.split(".")[1:])


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _root(node: ast.AST) -> tuple[str | None, list[str]]:
    """The name an attribute or subscript chain starts from, and the attributes along it."""
    chain = []
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Attribute):
            chain.append(node.attr)
        node = node.func if isinstance(node, ast.Call) else node.value
    return (node.id if isinstance(node, ast.Name) else None), chain[::-1]


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        targets = [node.optional_vars]
    else:
        return []
    return [t for target in targets for t in ast.walk(target) if isinstance(t, (ast.Attribute, ast.Subscript))
            and isinstance(t.ctx, (ast.Store, ast.Del))]
