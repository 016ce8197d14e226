"""A notebook run by ``kvlib.course.grading.execute`` leaves no kernel behind.

The lessons' and exercises' tests, and an instructor grading a class, run notebook after notebook
in one process: a kernel left running after each holds a Python with torch (hundreds of MB), so
they pile up until memory runs out.
"""
from __future__ import annotations

import nbformat
import psutil
import pytest
from nbclient.exceptions import CellExecutionError, CellTimeoutError

from kvlib.course.grading.execute import execute, execute_notebook


def _kernels() -> set[int]:
    """The ids of this process's descendants that are ipykernels."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "ipykernel" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def _alive(pids: set[int]) -> set[int]:
    """The processes of ``pids`` still running (a zombie has ended)."""
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _notebook(*sources: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    return nb


def _record_kernel(seen: set[int]):
    """An ``on_cell_execute`` hook that records the kernels running while a cell executes."""
    return lambda **_: seen.update(_kernels())


def test_no_kernel_outlives_an_executed_notebook(tmp_path):
    before, seen = _kernels(), set()
    nb = _notebook("import os\nos.getpid()")
    execute(nb, tmp_path, allow_errors=False, on_cell_execute=_record_kernel(seen))
    assert seen - before, "the test saw no kernel running while the cell ran"
    assert nb.cells[0].outputs, "the cell did not run"
    assert _alive(seen - before) == set()


def test_no_kernel_outlives_a_notebook_that_fails(tmp_path):
    before, seen = _kernels(), set()
    with pytest.raises(CellExecutionError):
        execute(_notebook("1 / 0", "print('never')"), tmp_path, allow_errors=False,
                on_cell_execute=_record_kernel(seen))
    assert seen - before and _alive(seen - before) == set()


def test_no_kernel_outlives_a_cell_that_times_out(tmp_path):
    before, seen = _kernels(), set()
    with pytest.raises(CellTimeoutError):
        execute(_notebook("import time\ntime.sleep(60)"), tmp_path, allow_errors=False, timeout=2,
                on_cell_execute=_record_kernel(seen))
    assert seen - before and _alive(seen - before) == set()


def test_notebooks_graded_one_after_another_leave_none_running(tmp_path):
    path = tmp_path / "small.ipynb"
    nbformat.write(_notebook("x = 1 + 1", "x"), path)
    before = _kernels()
    for _ in range(3):
        nb = execute_notebook(path, allow_errors=True)
        assert nb.cells[1].outputs[0]["data"]["text/plain"] == "2"
        assert _alive(_kernels() - before) == set()
