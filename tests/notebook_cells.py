"""A lab notebook's code cells as the grader reads them (hidden tests removed), optionally edited: the tests'
one way to load a solution, a lab, or a solution with a planted bug."""
from __future__ import annotations

from pathlib import Path

from kvlib.course.grading.runner import code_cells
from kvlib.course.labs import remove_hidden_tests


def graded_cells(path: Path, edits=()) -> list[str]:
    """``path``'s code cells without their hidden tests, each ``(old, new)`` of ``edits`` replacing text that must
    occur exactly once in the notebook."""
    cells = [remove_hidden_tests(source) for source in code_cells(path)]
    for old, new in edits:
        where = [i for i, source in enumerate(cells) if old in source]
        assert len(where) == 1 and cells[where[0]].count(old) == 1, f"{old!r} must occur once in {path.name}"
        cells[where[0]] = cells[where[0]].replace(old, new)
    return cells
