"""Take a learner's definitions out of a lab notebook, and nothing else.

The grader never runs the notebook. From its code cells it keeps the top-level ``def``, ``class``
and ``import`` statements and plain ``NAME = value`` assignments, the last definition of each
name winning as it would when the cells run top to bottom, and only those that the graded names
need (their closure). Everything else, a check cell, a last cell that rewrites a file, an
assignment that patches a module, is dropped unread.

What is kept is then read for what a graded definition may not do: reach kvlib's own
implementation of the piece it is graded on (an import, a subclass, a call), or reach around the
grader (the process, the file system, another module's internals through dunder attributes).
Either costs the task all its points, with a message that says which line did it.
"""
from __future__ import annotations

import ast
import linecache
import threading
from dataclasses import dataclass, field
from typing import Optional

import nbformat

# Modules a lab's code may import besides the kvlib names its task allows.
ALLOWED_MODULES = frozenset({
    "__future__", "abc", "bisect", "collections", "dataclasses", "enum", "functools", "heapq", "itertools",
    "math", "operator", "random", "statistics", "time", "typing", "numpy", "torch", "triton", "triton.language",
})
# Names and attributes that reach outside the learner's own code: the process, files, other modules.
FORBIDDEN_NAMES = frozenset({
    "__import__", "exec", "eval", "compile", "open", "globals", "locals", "vars", "getattr", "setattr",
    "delattr", "breakpoint", "input", "__builtins__", "memoryview",
})
FORBIDDEN_ATTRIBUTES = frozenset({
    "os", "sys", "subprocess", "importlib", "builtins", "shutil", "pathlib", "socket", "ctypes", "gc",
    "inspect", "pickle", "marshal", "io", "signal", "threading", "multiprocessing", "resource", "modules",
    "environ", "system", "popen", "kvlib",
})
ALLOWED_DUNDERS = frozenset({
    "__init__", "__post_init__", "__call__", "__len__", "__iter__", "__next__", "__getitem__", "__setitem__",
    "__contains__", "__repr__", "__str__", "__eq__", "__hash__", "__lt__", "__le__", "__gt__", "__ge__",
    "__enter__", "__exit__", "__bool__",
})
# A folder is graded by several threads, and CPython 3.11 keeps ``ast.parse``'s recursion count in
# per-interpreter state: two parses at once can fail with "SystemError: AST constructor recursion
# depth mismatch" (seen grading a class; python/cpython#106905). One parse at a time.
_PARSING = threading.Lock()


@dataclass(frozen=True)
class Statement:
    """One kept top-level statement, where it stood in the notebook (so errors point at the learner's line)."""

    cell: int  # 1-based, counting code cells
    first_line: int
    source: str

    @property
    def filename(self) -> str:
        return f"<cell {self.cell}>"

    def compile(self):
        """Code whose functions can show their source: ``@triton.jit`` reads it to compile a kernel."""
        filename = self.filename
        lines = list(linecache.cache.get(filename, (0, None, [], filename))[2])  # the cell's other statements
        lines += ["\n"] * (self.first_line - 1 - len(lines))
        own = [line if line.endswith("\n") else line + "\n" for line in self.source.splitlines(True)]
        lines[self.first_line - 1:self.first_line - 1 + len(own)] = own
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        return compile("\n" * (self.first_line - 1) + self.source, filename, "exec")


def load(statements: list[Statement], namespace: dict) -> None:
    """Run a notebook's kept statements in ``namespace``, in order. The source an earlier notebook
    registered for the same cells in this process is dropped first, so no function shows its lines."""
    for filename in {statement.filename for statement in statements}:
        linecache.cache.pop(filename, None)
    for statement in statements:
        exec(statement.compile(), namespace)  # noqa: S102 - the learner's definitions, checked by extract


@dataclass
class Extracted:
    """The learner's definitions, ready to run in a fresh namespace."""

    statements: list[Statement]  # the kept statements, in the order the notebook runs them
    defined: set[str]  # top-level names they define
    violations: list[str] = field(default_factory=list)  # why a task must score zero, one line each


@dataclass(frozen=True)
class Rules:
    """What the graded names of one task may import from kvlib, and what they must define themselves."""

    needs: tuple[str, ...]  # the names the task grades, e.g. ("MyBlockAllocator",)
    kvlib_imports: dict = field(default_factory=dict)  # module -> names the learner may import from it
    own_methods: tuple[str, ...] = ()  # methods the graded classes must define in their own body


def code_cells(path) -> list[str]:
    nb = nbformat.read(str(path), as_version=4)
    return [cell.source for cell in nb.cells if cell.cell_type == "code"]


def extract(cells: list[str], rules: Rules) -> Extracted:
    """The closure of ``rules.needs`` over the notebook's top-level definitions, with its violations."""
    statements: dict[str, ast.stmt] = {}
    origin: dict[int, Statement] = {}
    order: list[str] = []
    for number, source in enumerate(cells, 1):
        source = _without_magics(source)
        try:
            with _PARSING:
                tree = ast.parse(source)
        except SyntaxError as error:
            return Extracted([], set(), [f"code cell {number} does not parse: {error.msg} (line {error.lineno})"])
        lines = source.splitlines()
        for statement in tree.body:
            first = min([statement.lineno] + [d.lineno for d in getattr(statement, "decorator_list", [])])
            origin[id(statement)] = Statement(number, first, "\n".join(lines[first - 1:statement.end_lineno]))
            for name in _defines(statement):
                statements[name] = statement
                if name in order:
                    order.remove(name)
                order.append(name)
    missing = [n for n in rules.needs if n not in statements]
    if missing:
        return Extracted([], set(), [f"the notebook defines no {', '.join(missing)}: keep the name the lab gives"])
    kept = _closure(rules.needs, statements)
    ordered, seen = [], set()
    for name in order:
        statement = statements[name]
        if name in kept and id(statement) not in seen:
            seen.add(id(statement))
            ordered.append(statement)
    violations = _violations(ordered, rules, statements, origin)
    return Extracted([origin[id(s)] for s in ordered], kept, violations)


def _without_magics(source: str) -> str:
    """Comment out IPython magics and shell escapes, which are not Python."""
    return "\n".join("# " + line if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def _defines(statement: ast.stmt) -> list[str]:
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [statement.name]
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return [(alias.asname or alias.name).split(".")[0] for alias in statement.names]
    if isinstance(statement, ast.Assign) and all(isinstance(t, ast.Name) for t in statement.targets):
        return [t.id for t in statement.targets]
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.value:
        return [statement.target.id]
    return []  # expressions, attribute assignments, loops ...: not a definition, never graded


def _closure(needs: tuple[str, ...], statements: dict[str, ast.stmt]) -> set[str]:
    kept, todo = set(), list(needs)
    while todo:
        name = todo.pop()
        if name in kept or name not in statements:
            continue
        kept.add(name)
        todo.extend(_free_names(statements[name]))
    return kept


def _free_names(statement: ast.stmt) -> set[str]:
    """Names a statement reads without binding them itself (its arguments and locals are its own)."""
    bound, loaded = set(), set()
    for node in ast.walk(statement):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not statement:
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and node is not statement:
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound


def _violations(kept: list[ast.stmt], rules: Rules, statements: dict[str, ast.stmt], origin: dict) -> list[str]:
    found = []
    from_kvlib = {(alias.asname or alias.name) for s in kept for node in ast.walk(s) if isinstance(node, ast.ImportFrom)
                  and (node.module or "").split(".")[0] == "kvlib" for alias in node.names}
    for statement in kept:
        cell = origin[id(statement)].cell

        def flag(node: ast.AST, why: str) -> None:
            found.append(f"code cell {cell}, line {getattr(node, 'lineno', '?')}: {why}")
        _check_statement(statement, rules, from_kvlib, flag)
    return found


def _check_statement(statement: ast.stmt, rules: Rules, from_kvlib: set[str], flag) -> None:
    for node in ast.walk(statement):
        if isinstance(node, ast.ImportFrom):
            module_name = ("." * node.level) + (node.module or "")
            for alias in node.names:
                _check_import(module_name, alias.name, rules, node, flag)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                _check_import(alias.name, None, rules, node, flag)
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            flag(node, f"uses {node.id}, which graded code may not use")
        elif isinstance(node, ast.Attribute):
            if node.attr in rules.own_methods and _is_super_call(node.value):
                flag(node, f"calls super().{node.attr}: a graded method must do its work itself")
            elif node.attr in rules.own_methods and isinstance(node.value, ast.Name) and node.value.id in from_kvlib:
                flag(node, f"calls kvlib's own {node.value.id}.{node.attr}: a graded method must do its work itself")
            elif node.attr in FORBIDDEN_ATTRIBUTES:
                flag(node, f"reaches .{node.attr}, outside your own code")
            elif node.attr.startswith("__") and node.attr.endswith("__") and node.attr not in ALLOWED_DUNDERS:
                flag(node, f"reaches {node.attr}, an interpreter internal")
    if isinstance(statement, ast.ClassDef) and statement.name in rules.needs:
        own = {n.name for n in statement.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        missing = [m for m in rules.own_methods if m not in own]
        if missing:
            flag(statement, f"{statement.name} must define {', '.join(missing)} itself, not inherit them")


def _is_super_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _check_import(module_name: str, name: Optional[str], rules: Rules, node: ast.AST, flag) -> None:
    top = module_name.split(".")[0]
    if top == "kvlib":
        allowed = rules.kvlib_imports.get(module_name)
        if allowed is None or name is None or (name not in allowed and "*" not in allowed):
            what = f"{name} from {module_name}" if name else module_name
            flag(node, f"imports {what}: a task is graded on your own implementation, so it may not use "
                       f"kvlib's; allowed from kvlib: {_describe(rules.kvlib_imports)}")
    elif module_name not in ALLOWED_MODULES and top not in ALLOWED_MODULES:
        flag(node, f"imports {module_name}, which graded code may not use (allowed: {', '.join(sorted(ALLOWED_MODULES))})")


def _describe(imports: dict) -> str:
    if not imports:
        return "nothing"
    return "; ".join(f"{', '.join(sorted(names))} from {module}" for module, names in sorted(imports.items()))
