"""Execute a learner's notebook (``kvlib grade NOTEBOOK``) and collect the score of every task.

The lab's tasks come from the notebook's metadata (``{"kvlib": {"lab": "lab02"}}`` names
``kvlib.course.grading.lab02``), so a task whose grading cell never ran still shows, with zero points.
"""
from __future__ import annotations

import importlib
import tempfile
from pathlib import Path
from typing import Optional

import nbformat
from nbclient.exceptions import DeadKernelError

from kvlib.course.grading.checks import Task
from kvlib.course.grading.execute import CELL_TIMEOUT_S, execute
from kvlib.course.grading.record import SCORE_FILE_ENV, read_scores
from kvlib.course.grading.report import CellError, GradeReport


def grade_notebook(path: str | Path, timeout: int = CELL_TIMEOUT_S) -> GradeReport:
    """Execute the notebook (errors do not stop it; each cell gets ``timeout`` seconds) and score it."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    crash: Optional[CellError] = None
    started: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        score_file = Path(tmp) / "scores.json"
        try:
            execute(nb, path.parent, allow_errors=True, timeout=timeout, env={SCORE_FILE_ENV: str(score_file)},
                    on_cell_execute=lambda cell, cell_index: started.append(cell_index + 1))
        except DeadKernelError:
            crash = CellError(started[-1], "the kernel died (a crash, or out of memory); later cells did not run")
        scores = read_scores(score_file)
    errors = _cell_errors(nb, timeout) + ([crash] if crash else [])
    why = "its grading cell did not finish" + (f" (see cell {errors[0].cell})" if errors else "")
    tasks = [scores.pop(task.name, None) or task.not_run(why) for task in lab_tasks(nb)]
    return GradeReport(path, tasks + list(scores.values()), errors)


def lab_tasks(nb: nbformat.NotebookNode) -> list[Task]:
    lab = nb.metadata.get("kvlib", {}).get("lab")
    return importlib.import_module(f"kvlib.course.grading.{lab}").TASKS if lab else []


def _cell_errors(nb: nbformat.NotebookNode, timeout: int) -> list[CellError]:
    return [CellError(index, _describe(out, timeout))
            for index, cell in enumerate(nb.cells, 1) if cell.cell_type == "code"
            for out in cell.get("outputs", []) if out.output_type == "error"]


def _describe(error_output, timeout: int) -> str:
    if error_output.ename == "KeyboardInterrupt":  # the grader interrupts only a cell that overran
        return f"ran past the time limit of {timeout} s per cell and was interrupted"
    return f"{error_output.ename}: {error_output.evalue}"
