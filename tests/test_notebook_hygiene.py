"""Course notebooks: committed clean, sharing one first cell, labs in step with solutions and runnable.

nbval (configured in pyproject.toml) runs notebooks/ and solutions/; the labs are run here, with
their stubs in place, to prove a learner can run a lab top to bottom before writing any code.
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Optional

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


def run_to_the_end(path: Path) -> Optional[str]:
    """None if ``path`` runs top to bottom without an error, else what went wrong."""
    try:
        execute_notebook(path, allow_errors=False)
    except Exception as exc:  # noqa: BLE001 - reported by the test of this notebook
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="module")
def runs() -> dict[Path, Optional[str]]:
    """Every lab and the template run, two at a time: each runs in its own kernel process, and one at
    a time the test process would wait on one kernel while the second core idles."""
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(RUNNABLE, pool.map(run_to_the_end, RUNNABLE)))


@pytest.mark.parametrize("path", RUNNABLE, ids=_name)
def test_runs_top_to_bottom(path, runs):
    assert runs[path] is None, f"{_name(path)}: {runs[path]}"
