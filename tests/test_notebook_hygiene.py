"""Course notebooks: committed clean, sharing one first cell, labs in step with solutions and runnable.

nbval (configured in pyproject.toml) runs notebooks/ and solutions/; the labs are run here, with
their stubs in place, to prove a learner can run a lab top to bottom before writing any code.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from kvlib.course.grading.execute import execute_notebook
from kvlib.course.labs import stale_labs
from kvlib.course.notebook_setup import FIRST_CELL

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for folder in ("notebooks", "solutions", "labs", "templates")
                   for p in (ROOT / folder).rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
RUNNABLE = sorted((ROOT / "labs").glob("lab*.ipynb")) + [ROOT / "templates" / "lesson_template.ipynb"]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells, 1) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{_name(path)}: cells {dirty} have outputs or execution counts; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_first_code_cell_is_the_shared_setup_cell(path):
    nb = nbformat.read(path, as_version=4)
    first = next((c.source for c in nb.cells if c.cell_type == "code"), None)
    assert first == FIRST_CELL, f"{_name(path)}: the first code cell must be kvlib.course.notebook_setup.FIRST_CELL"


def test_labs_match_a_fresh_generation_from_solutions():
    stale = stale_labs(ROOT / "solutions", ROOT / "labs")
    assert not stale, f"out of date with solutions/: {[_name(p) for p in stale]}; run `kvlib make-labs`"


@pytest.mark.parametrize("path", RUNNABLE, ids=_name)
def test_runs_top_to_bottom(path):
    execute_notebook(path, allow_errors=False)
