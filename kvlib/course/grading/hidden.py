"""kvlib without its own answer to a task: the copy of the package a grading sandbox runs on.

A task names what it hides (``Task.hidden``: ``"kvlib.core.block_allocator:BlockAllocator"``, a method
``"kvlib.core.scheduler:Scheduler.schedule_running"``, or a whole module ``"kvlib.kernels.paged_decode:*"``).
:func:`stubbed_tree` writes a copy of kvlib in which each of those is a stub that raises
NotImplementedError, the rest of the engine intact; the sandbox imports kvlib from that copy only,
so no import, string, object walk or file read in the learner's process can reach the answer.
:func:`hiding` puts the same stubs in place in this process while a notebook's feedback runs the
learner's code, so feedback and grade agree on code that leans on kvlib's own version.
"""
from __future__ import annotations

import ast
import atexit
import functools
import importlib
import shutil
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import kvlib

PACKAGE = Path(kvlib.__file__).resolve().parent
_TREES: dict[frozenset, Path] = {}
_BUILDING = threading.Lock()


def resolve(entry: str):
    """The object ``entry`` names, in this process."""
    module, qualname = parse(entry)
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def kvlibs_own(entry: str) -> Callable[[], Any]:
    """A task's ``reference``: kvlib's own piece named by ``entry``, looked up only when the grader asks."""
    return lambda: resolve(entry)


def message(qualname: str) -> str:
    return (f"kvlib's own {qualname} is not there while this task is graded: the task grades your code, "
            f"so it must do this work itself")


def parse(entry: str) -> tuple[str, str]:
    module, _, qualname = entry.partition(":")
    if not module.startswith("kvlib") or not qualname:
        raise ValueError(f"a hidden entry is 'kvlib.module:Qualname' or 'kvlib.module:*', not {entry!r}")
    return module, qualname


def module_file(module: str, root: Path = PACKAGE) -> Path:
    relative = Path(*module.split(".")[1:])
    path = root / relative.with_suffix(".py")
    return path if path.is_file() else root / relative / "__init__.py"


def stubbed_tree(hidden: tuple[str, ...]) -> Path:
    """A folder holding ``kvlib/`` with ``hidden`` stubbed; built once per set in this process."""
    key = frozenset(hidden)
    with _BUILDING:
        if key not in _TREES:
            root = Path(tempfile.mkdtemp(prefix="kvlib-graded-"))
            root.chmod(0o755)  # read by the sandbox, which runs as nobody where the grader is root
            atexit.register(shutil.rmtree, root, True)
            shutil.copytree(PACKAGE, root / "kvlib", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            by_module: dict[str, set[str]] = {}
            for entry in hidden:
                module, qualname = parse(entry)
                by_module.setdefault(module, set()).add(qualname)
            for module, names in by_module.items():
                path = module_file(module, root / "kvlib")
                path.write_text(stub_source(path.read_text(), names))
            _TREES[key] = root
        return _TREES[key]


def stub_source(source: str, names: set[str]) -> str:
    """``source`` with every function whose qualified name is in ``names`` (or inside a class that is, or
    anywhere when ``"*"`` is) replaced by a stub raising NotImplementedError."""
    tree = ast.parse(source)
    found: set[str] = set()

    def visit(body: list, prefix: str, hide_all: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = prefix + node.name
                hidden = hide_all or "*" in names or qualname in names
                if hidden:
                    found.add(qualname)
                if isinstance(node, ast.ClassDef):
                    visit(node.body, qualname + ".", hidden)
                elif hidden:
                    node.body = [ast.Raise(ast.Call(ast.Name("NotImplementedError", ast.Load()),
                                                    [ast.Constant(message(qualname))], []), None)]
    visit(tree.body, "", False)
    missing = names - found - {"*"}
    if missing:
        raise ValueError(f"nothing named {', '.join(sorted(missing))} to hide")
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


@functools.cache
def hidden_source(hidden: tuple[str, ...]) -> dict[str, str]:
    """The source of each hidden definition, as kvlib has it (what a copy would resemble); read once."""
    out = {}
    for entry in hidden:
        module, qualname = parse(entry)
        tree = ast.parse(module_file(module).read_text())
        if qualname == "*":
            out[entry] = ast.unparse(tree)
            continue
        node = _find(tree.body, qualname.split("."))
        out[entry] = ast.unparse(node) if node is not None else ""
    return out


def _find(body: list, parts: list[str]):
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == parts[0]:
            return node if len(parts) == 1 else _find(getattr(node, "body", []), parts[1:])
    return None


@contextmanager
def hiding(hidden: tuple[str, ...]) -> Iterator[None]:
    """While the block runs, every hidden function of this process raises NotImplementedError."""
    saved = []
    for entry in hidden:
        module_name, qualname = parse(entry)
        module = importlib.import_module(module_name)
        if qualname == "*":
            targets = [(module, name) for name, value in vars(module).items()
                       if callable(value) and getattr(value, "__module__", None) == module_name]
        else:
            owner_path, _, name = qualname.rpartition(".")
            owner = resolve(f"{module_name}:{owner_path}") if owner_path else module
            value = vars(owner)[name]
            targets = [(value, n) for n, v in vars(value).items() if _is_function(v)] if isinstance(value, type) \
                else [(owner, name)]
        for owner, name in targets:
            original = vars(owner)[name]
            saved.append((owner, name, original))
            setattr(owner, name, _stub_like(original, f"{getattr(owner, '__qualname__', module_name)}.{name}"))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _is_function(value) -> bool:
    return isinstance(value, (staticmethod, classmethod, property)) or hasattr(value, "__code__")


def _stub_like(original, qualname: str):
    def stub(*args, **kwargs):
        raise NotImplementedError(message(qualname))
    if isinstance(original, property):
        return property(stub)
    if isinstance(original, staticmethod):
        return staticmethod(stub)
    if isinstance(original, classmethod):
        return classmethod(stub)
    return stub
