"""Generate the student labs from the instructor solutions, the single source of each lab.

In ``solutions/labNN_topic.ipynb`` each ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` region
becomes a stub that raises NotImplementedError naming the function to write, and each
``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS`` region is removed. Regions must sit
inside a function body, so a stub raises only when the learner's code is called (by a graded
check, which scores it "not implemented") and the lab still runs top to bottom.

A marker that is almost right (``## BEGIN SOLUTION``, ``### Begin Solution``) or sits outside a
code cell would leave a solution in the lab, so it is refused, as is a lab with no stub at all;
and ``labs/`` is replaced all at once, so an error leaves the previous labs in place.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import nbformat

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
LAB_PATTERN = "lab*.ipynb"
MARKERS = (BEGIN_SOLUTION, END_SOLUTION, BEGIN_HIDDEN, END_HIDDEN)
_MARKER_LIKE = re.compile(r"#+\s*(begin|end)[\W_]*(solution|hidden[\W_]*tests?)", re.IGNORECASE)
_DEF = re.compile(r"^(\s*)(?:async\s+)?def\s+(\w+)")
_CLASS = re.compile(r"^(\s*)class\s+(\w+)")


class LabError(ValueError):
    """A solution notebook whose markers cannot be turned into a runnable lab."""


def make_labs(solutions_dir: str | Path = "solutions", labs_dir: str | Path = "labs") -> list[Path]:
    """Write ``labs_dir/labNN_topic.ipynb`` for every solution, all or nothing; return the paths written."""
    labs_dir = Path(labs_dir)
    rendered = {solution.name: render_lab(solution) for solution in sorted(Path(solutions_dir).glob(LAB_PATTERN))}
    staging = Path(tempfile.mkdtemp(prefix=".labs-", dir=labs_dir.parent if labs_dir.parent.exists() else None))
    for name, text in rendered.items():
        (staging / name).write_text(text)
    old = labs_dir.with_name(labs_dir.name + ".old")
    if labs_dir.exists():
        os.replace(labs_dir, old)
    os.replace(staging, labs_dir)
    shutil.rmtree(old, ignore_errors=True)
    return [labs_dir / name for name in rendered]


def stale_labs(solutions_dir: str | Path = "solutions", labs_dir: str | Path = "labs") -> list[Path]:
    """Labs that differ from a fresh generation, are missing, or have no solution any more."""
    solutions = {p.name: p for p in Path(solutions_dir).glob(LAB_PATTERN)}
    labs = {p.name: p for p in Path(labs_dir).glob(LAB_PATTERN)}
    stale = [Path(labs_dir) / name for name in solutions
             if name not in labs or labs[name].read_text() != render_lab(solutions[name])]
    return sorted(stale + [labs[name] for name in labs.keys() - solutions.keys()])


def render_lab(solution: Path) -> str:
    """The lab notebook's file content for one solution notebook, outputs cleared."""
    nb = nbformat.read(solution, as_version=4)
    cells, stubs = [], 0
    for number, cell in enumerate(nb.cells, 1):
        where = f"{solution}, cell {number}"
        check_markers(cell.source, cell.cell_type, where)
        if cell.cell_type == "code":
            stubs += sum(1 for line in cell.source.splitlines() if line.strip() == BEGIN_SOLUTION)
            cell.source = strip_solutions(remove_hidden_tests(cell.source, where), where)
            cell.outputs, cell.execution_count = [], None
            if not cell.source.strip():
                continue
        cells.append(cell)
    _expect(stubs > 0, f"{solution}: no {BEGIN_SOLUTION} region, so the lab would ask the learner for nothing")
    nb.cells = cells
    return nbformat.writes(nb) + "\n"


def check_markers(source: str, cell_type: str, where: str) -> None:
    """Refuse near-miss markers, which would leave a solution in the lab, and markers outside code cells."""
    for number, line in enumerate(source.splitlines(), 1):
        if not _MARKER_LIKE.search(line):
            continue
        _expect(cell_type == "code", f"{where}, line {number}: {line.strip()!r} in a {cell_type} cell; solution "
                                     f"and hidden-test markers belong in code cells")
        _expect(line.strip() in MARKERS, f"{where}, line {number}: {line.strip()!r} looks like a marker but is not "
                                         f"one of {', '.join(MARKERS)}; write it exactly, on a line of its own")


def remove_hidden_tests(source: str, where: str = "cell") -> str:
    lines, kept, hidden = source.splitlines(), [], False
    for number, line in enumerate(lines, 1):
        marker = line.strip()
        if marker == BEGIN_HIDDEN:
            _expect(not hidden, f"{where}, line {number}: {BEGIN_HIDDEN} inside another hidden region")
            hidden = True
        elif marker == END_HIDDEN:
            _expect(hidden, f"{where}, line {number}: {END_HIDDEN} without {BEGIN_HIDDEN}")
            hidden = False
        elif not hidden:
            kept.append(line)
    _expect(not hidden, f"{where}: {BEGIN_HIDDEN} is never closed by {END_HIDDEN}")
    return "\n".join(kept).rstrip()


def strip_solutions(source: str, where: str = "cell") -> str:
    """Replace each solution region with ``raise NotImplementedError("Class.method")``."""
    lines, kept, begin = source.splitlines(), [], None
    for number, line in enumerate(lines, 1):
        marker = line.strip()
        if marker == BEGIN_SOLUTION:
            _expect(begin is None, f"{where}, line {number}: {BEGIN_SOLUTION} inside another solution region")
            begin = number
            indent = line[: len(line) - len(line.lstrip())]
            name = enclosing_function(lines[: number - 1], len(indent))
            _expect(name is not None, f"{where}, line {number}: a solution region must sit inside a function body, "
                                      f"so that its stub raises only when the function is called")
            kept.append(f'{indent}raise NotImplementedError("{name}")')
        elif marker == END_SOLUTION:
            _expect(begin is not None, f"{where}, line {number}: {END_SOLUTION} without {BEGIN_SOLUTION}")
            begin = None
        elif begin is None:
            kept.append(line)
    _expect(begin is None, f"{where}, line {begin}: {BEGIN_SOLUTION} is never closed by {END_SOLUTION}")
    return "\n".join(kept)


def enclosing_function(lines_above: list[str], indent: int) -> str | None:
    """``Class.method`` (or ``function``) whose body holds a line indented by ``indent``, else None.

    Walking up, each line indented less than the current level opens a block that encloses the
    region; the names of the enclosing ``def`` and ``class`` blocks make the qualified name.
    """
    names: list[str] = []
    for line in reversed(lines_above):
        stripped = line.lstrip()
        if not stripped or stripped.startswith("#") or len(line) - len(stripped) >= indent:
            continue
        indent = len(line) - len(stripped)
        match = _DEF.match(line) or _CLASS.match(line)
        if match and not names and match.re is _CLASS:
            return None  # a class body, not a function body: the stub would raise at definition
        if match:
            names.append(match.group(2))
    return ".".join(reversed(names)) or None


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise LabError(message)
