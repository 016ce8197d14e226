"""``kvlib grade``: a lab notebook's score, computed where the notebook cannot reach.

The lab and its tasks come from the grader (the ``labNN`` in the file name, or ``--lab``), never
from the notebook's metadata. No cell of the notebook runs: each task's definitions are
extracted from the saved file (``extract.py``), refused if they reach kvlib's own implementation
or around the grader, and otherwise graded check by check in a sandbox process
(``sandbox.py``). A folder of submissions is graded in parallel, one sandbox each, into a CSV
gradebook; one broken or hostile submission cannot stop or alter the others.
"""
from __future__ import annotations

import datetime
import importlib
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from kvlib.course.grading.extract import code_cells, extract
from kvlib.course.grading.report import GradeReport
from kvlib.course.grading.results import NOT_ALLOWED, NOT_GRADED, TaskResult
from kvlib.course.grading.sandbox import Limits, Sandbox

LAB_NAME = re.compile(r"lab\d\d")


def lab_of(path: str | Path) -> str:
    """``labNN`` from a notebook's file name; the grader knows each lab's tasks by that name alone."""
    match = LAB_NAME.search(Path(path).name)
    if match is None or importlib.util.find_spec(f"kvlib.course.grading.{match.group()}") is None:
        raise ValueError(f"cannot tell which lab {Path(path).name} is: its name should start with the lab's, e.g. "
                         f"lab02_allocator.ipynb, or pass --lab lab02")
    return match.group()


def grade_notebook(path: str | Path, lab: Optional[str] = None, limits: Limits = Limits()) -> GradeReport:
    path = Path(path)
    lab = lab or lab_of(path)
    tasks = grade_cells(lab, code_cells(path), limits)
    saved = datetime.datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y-%m-%d %H:%M:%S")
    notes = [f"graded {path.name} as saved at {saved}: edits not saved to the file are not graded"]
    return GradeReport(path, lab, tasks, notes)


def grade_cells(lab: str, cells: list[str], limits: Limits = Limits(), runner=Sandbox) -> list[TaskResult]:
    """Every task of ``lab`` on the learner's code cells, each check run by ``runner`` (a sandbox process)."""
    tasks = importlib.import_module(f"kvlib.course.grading.{lab}").TASKS
    results: dict[str, TaskResult] = {}
    runnable, statements = [], {}
    for task in tasks:
        extracted = extract(cells, task.rules)
        if extracted.violations:
            results[task.name] = task.zero(NOT_ALLOWED, "; ".join(extracted.violations))
            continue
        runnable.append(task)
        statements.update(((s.cell, s.first_line), s) for s in extracted.statements)
    with runner(lab, [statements[k] for k in sorted(statements)], limits) as sandbox:
        for task in runnable:
            results[task.name] = TaskResult(task.name, [sandbox.run(task.name, c.name, c.points, c.limit_s)
                                                        for c in task.checks])
    return [results[t.name] for t in tasks]


def grade_folder(folder: str | Path, lab: Optional[str] = None, jobs: int = 2,
                 limits: Limits = Limits()) -> list[GradeReport]:
    """Every ``*.ipynb`` in ``folder``, ``jobs`` at a time, in submission-name order."""
    paths = sorted(Path(folder).glob("*.ipynb"))
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda p: _grade_one(p, lab, limits), paths))


def _grade_one(path: Path, lab: Optional[str], limits: Limits) -> GradeReport:
    """One submission's report, whatever is wrong with it: an unreadable one scores zero on every task
    of its lab, so its gradebook row has the same columns and maximum as the others."""
    try:
        lab = lab or lab_of(path)
    except ValueError as exc:
        return GradeReport(path, "?", [], [str(exc)])
    try:
        return grade_notebook(path, lab, limits)
    except Exception as exc:  # noqa: BLE001 - an unreadable submission is reported, the others still grade
        why = f"{type(exc).__name__}: {exc}"
        tasks = importlib.import_module(f"kvlib.course.grading.{lab}").TASKS
        return GradeReport(path, lab, [task.zero(NOT_GRADED, why) for task in tasks], [f"could not be graded: {why}"])


def grade_here() -> None:
    """From inside a lab notebook: grade the notebook you have open, as ``kvlib grade`` would.

    In Colab the open notebook is fetched from the browser; in Jupyter it is the file on disk, so
    unsaved edits are not graded, and a warning says so when cells ran after the last save.
    """
    path = _open_notebook()
    last_run = float(os.environ.get("KVLIB_LAST_CELL_RUN", "0"))
    if path.stat().st_mtime + 1 < last_run:
        print(f"warning: {path.name} on disk is older than the cells you ran since: save it (Ctrl+S) first, "
              f"or your latest code is not graded")
    result = subprocess.run([sys.executable, "-m", "kvlib.cli", "grade", str(path)], capture_output=True, text=True)
    print(result.stdout or result.stderr)


def _open_notebook() -> Path:
    if "google.colab" in sys.modules:
        import json
        import tempfile

        from google.colab import _message  # noqa: PLC0415 - exists only in Colab
        notebook = _message.blocking_request("get_ipynb", timeout_sec=60)["ipynb"]
        name = os.environ.get("KVLIB_LAB_FILE", "lab.ipynb")
        path = Path(tempfile.mkdtemp()) / name
        path.write_text(json.dumps(notebook))
        return path
    session = os.environ.get("JPY_SESSION_NAME")
    if session and Path(session).is_file():
        return Path(session)
    raise RuntimeError("cannot find this notebook's file: run `kvlib grade labs/labNN_topic.ipynb` in a terminal")


def mark_cell_run() -> None:
    """Registered by the notebooks' first cell: when a cell last ran, to compare with the file's save time."""
    os.environ["KVLIB_LAST_CELL_RUN"] = str(time.time())

