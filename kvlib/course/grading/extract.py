"""Take a learner's definitions out of a lab notebook, and nothing else.

The grader never runs the notebook. From its code cells it keeps the top-level ``def``, ``class``
and ``import`` statements and plain ``NAME = value`` assignments that the graded names need (their
closure), every definition of such a name in notebook order, so a later one wins as when the cells
run top to bottom. Everything else, a check cell, a last cell that rewrites a file, an assignment
that patches a module, is dropped unread.

What is kept runs as a module of its own (``learner``, in ``sys.modules``), compiled with no
``__future__`` flags but its own, so dataclasses, enums and typing work as they do in the notebook.
Nothing here decides whether code is allowed: the sandbox it runs in holds no answer to reach.
"""
from __future__ import annotations

import ast
import linecache
import sys
import threading
import types
from dataclasses import dataclass, field

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
        return compile("\n" * (self.first_line - 1) + self.source, filename, "exec", dont_inherit=True)


LEARNER_MODULE = "learner"


def load(statements: list[Statement]) -> types.ModuleType:
    """Run a notebook's kept statements, in order, as the module ``learner``. The source an earlier
    notebook registered for the same cells in this process is dropped first, so no function shows its lines."""
    for filename in {statement.filename for statement in statements}:
        linecache.cache.pop(filename, None)
    module = types.ModuleType(LEARNER_MODULE)
    sys.modules[LEARNER_MODULE] = module
    for statement in statements:
        exec(statement.compile(), module.__dict__)  # noqa: S102 - the learner's definitions, in the sandbox
    return module


@dataclass
class Extracted:
    """The learner's definitions, ready to run in a fresh namespace."""

    statements: list[Statement]  # the kept statements, in the order the notebook runs them
    defined: set[str]  # top-level names they define
    problems: list[str] = field(default_factory=list)  # why nothing can be graded, one line each


def extract(cells: list[str], needs: tuple[str, ...]) -> Extracted:
    """The closure of ``needs`` over the notebook's top-level definitions."""
    definitions: dict[str, list[ast.stmt]] = {}
    origin: dict[int, Statement] = {}
    in_order: list[ast.stmt] = []
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
            in_order.append(statement)
            for name in _defines(statement):
                definitions.setdefault(name, []).append(statement)
    missing = [n for n in needs if n not in definitions]
    if missing:
        return Extracted([], set(), [f"the notebook defines no {', '.join(missing)}: keep the name the lab gives"])
    kept = _closure(needs, definitions)
    ordered = [s for s in in_order if any(name in kept for name in _defines(s))]
    return Extracted([origin[id(s)] for s in ordered], kept)


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


def _closure(needs: tuple[str, ...], definitions: dict[str, list[ast.stmt]]) -> set[str]:
    """Every name the graded names need; each definition of a name counts, since the cells run in order
    and an earlier cell's class may read an import that a later cell repeats."""
    kept, todo = set(), list(needs)
    while todo:
        name = todo.pop()
        if name in kept or name not in definitions:
            continue
        kept.add(name)
        for statement in definitions[name]:
            todo.extend(_free_names(statement))
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
