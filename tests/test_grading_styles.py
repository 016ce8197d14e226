"""Honest solutions in other styles get full marks in every lab (``restyle.py`` writes them).

One restyled solution per lab carries all of the styles at once (imports under other names, slotted
classes, methods bound from module-level functions, everything in one cell), graded as the grader
runs checks; the labs that grade in seconds also get each style alone.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from restyle import STYLES, graded_source

from kvlib.course.grading.runner import InProcess, grade_cells, tasks_of
from kvlib.course.grading.results import PASS

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted(p.name[:5] for p in (ROOT / "solutions").glob("lab*.ipynb"))
QUICK = ("lab02", "lab04", "lab05", "lab06", "lab08", "lab10")  # labs whose every check takes seconds


def _restyled(lab: str, styles: tuple[str, ...]) -> str:
    needs = tuple(sorted({name for task in tasks_of(lab) for name in task.needs}))
    source = graded_source(next((ROOT / "solutions").glob(f"{lab}_*.ipynb")), needs)
    for style in styles:
        source = STYLES[style](source, needs)
    return source


def _lost(lab: str, source: str) -> list[str]:
    graded = grade_cells(lab, [source], runner=InProcess, seed=3)
    return [f"{t.task}/{c.name}: {c.message}" for t in graded.tasks for c in t.checks if c.status != PASS]


@pytest.mark.parametrize("lab", LABS)
def test_a_solution_in_every_style_at_once_gets_full_marks(lab):
    source = _restyled(lab, ("aliased_imports", "slotted", "methods_outside"))
    assert source != ast.unparse(ast.parse(_restyled(lab, ())))
    assert _lost(lab, source) == []


@pytest.mark.parametrize("lab, style", [(lab, style) for lab in QUICK for style in STYLES])
def test_a_solution_in_each_style_gets_full_marks(lab, style):
    assert _lost(lab, _restyled(lab, (style,))) == []


def test_the_styles_change_what_they_say():
    source = "import math\nfrom collections import deque\n\n\nclass MyPool:\n    def __init__(self):\n" \
             "        self.free = deque([math.pi])\n\n    def take(self):\n        return self.free.pop()\n"
    aliased = STYLES["aliased_imports"](source, ("MyPool",))
    assert "import math as _math_" in aliased and "_deque_([_math_.pi])" in aliased
    assert "__slots__ = ('free',)" in STYLES["slotted"](source, ("MyPool",))
    outside = STYLES["methods_outside"](source, ("MyPool",))
    assert "def _MyPool_take(self):" in outside and "take = _MyPool_take" in outside
    for style in STYLES.values():
        namespace: dict = {}
        exec(compile(style(source, ("MyPool",)), "<style>", "exec"), namespace)  # noqa: S102 - the test's own code
        assert namespace["MyPool"]().take() == pytest.approx(3.14159, abs=1e-5)
