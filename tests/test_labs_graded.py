"""Every lab: the solution gets full marks, the untouched lab zero, and each realistic bug loses points.

The bugs are test data (``tests/lab_bugs/labNN.py``): edits of the solution notebook, each with
the checks it must fail. Graded in this process (the same extraction and checks as ``kvlib
grade``, without the sandbox, whose isolation ``tests/test_grading.py`` covers), so the whole
suite stays fast; a bug that reads out of bounds, and may crash the process running it, is graded
in the sandbox.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from notebook_cells import graded_cells

from kvlib.course.grading.results import NOT_IMPLEMENTED, PASS
from kvlib.course.grading.runner import InProcess, grade_cells, lab_of
from kvlib.course.grading.sandbox import Sandbox

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("lab*.ipynb"))
LABS_WITH_BUGS = [p for p in SOLUTIONS if importlib.util.find_spec(f"lab_bugs.{lab_of(p)}")]
SEED = 2026  # one seed, so a run is repeatable; each lab's own tests draw several


def failed(graded) -> set[str]:
    return {f"{t.task}/{c.name}" for t in graded.tasks for c in t.checks if c.status != PASS}


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_the_solution_gets_full_marks(solution):
    results = grade_cells(lab_of(solution), graded_cells(solution), runner=InProcess, seed=SEED)
    assert failed(results) == set(), [r for r in results.tasks if not r.full_marks]


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_the_untouched_lab_gets_zero_and_says_not_implemented(solution):
    results = grade_cells(lab_of(solution), graded_cells(ROOT / "labs" / solution.name), runner=InProcess, seed=SEED)
    assert sum(t.points for t in results.tasks) == 0
    assert {c.status for t in results.tasks for c in t.checks} == {NOT_IMPLEMENTED}


def _bugs():
    for solution in LABS_WITH_BUGS:
        for bug in importlib.import_module(f"lab_bugs.{lab_of(solution)}").BUGS:
            yield pytest.param(solution, bug, id=f"{solution.stem}: {bug.name}")


@pytest.mark.parametrize("solution, bug", _bugs())
def test_a_realistic_bug_loses_the_points_of_what_it_breaks(solution, bug):
    runner = Sandbox if bug.sandboxed else InProcess
    results = grade_cells(lab_of(solution), graded_cells(solution, bug.edits), runner=runner, seed=SEED)
    lost = failed(results)
    assert bug.fails <= lost, f"expected {sorted(bug.fails)} to fail, failed: {sorted(lost)}"
    assert all(c.message for t in results.tasks for c in t.checks if c.status != PASS)


def test_every_lab_has_at_least_six_bugs():
    counts = {lab_of(p): len(importlib.import_module(f"lab_bugs.{lab_of(p)}").BUGS) for p in LABS_WITH_BUGS}
    assert all(n >= 6 for n in counts.values()), counts
