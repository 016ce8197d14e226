"""Grades nobody can forge: extraction, the sandbox, whole notebooks, forged and delegating ones, a class.

Lab 02 is the worked example of the pattern every lab's tests follow (``tests/test_labs_graded.py``
runs the same for all labs): the solution gets full marks, the untouched lab zero with a clear
message, each realistic bug of ``tests/lab_bugs`` costs points, and forged or delegating notebooks
get zero.
"""
from __future__ import annotations

import ast
import csv
import inspect
import json
import threading
import time
from pathlib import Path

import nbformat
import pytest

from kvlib.course.grading import Task, expect
from kvlib.course.grading.extract import Rules, extract, load
from kvlib.course.grading.report import write_gradebook
from kvlib.course.grading.results import CRASHED, FAIL, NOT_ALLOWED, NOT_IMPLEMENTED, PASS, TIMED_OUT
from kvlib.course.grading.runner import grade_folder, grade_notebook, lab_of
from kvlib.course.grading.sandbox import InProcess, Limits, Sandbox
from kvlib.course.labs import remove_hidden_tests

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab02_allocator.ipynb"
LAB = ROOT / "labs" / "lab02_allocator.ipynb"
ALLOCATOR = Rules(needs=("Pool",), kvlib_imports={"kvlib.block_allocator": {"AllocStatus"}}, own_methods=("free",))


# ---- in the notebook: feedback ------------------------------------------------------------------
def _toy_task() -> Task:
    task = Task("toy", Rules(needs=("answer",)))

    @task.check(2, "return 4")
    def answer(fn):
        expect(fn() == 4, f"got {fn()}")

    @task.check(1, "do not crash")
    def runs(fn):
        fn()
    return task


def test_feedback_prints_a_line_per_check(capsys):
    result = _toy_task().grade(lambda: 5)
    assert (result.points, result.max_points) == (1, 3)
    assert capsys.readouterr().out == "FAIL toy/answer: got 5\n     hint: return 4\nPASS toy/runs\ntoy: 1/3 points\n"


def test_a_stub_scores_zero_as_not_implemented_and_other_errors_fail_one_check():
    def stub():
        raise NotImplementedError("Toy.answer")
    result = _toy_task().grade(stub)
    assert [c.status for c in result.checks] == [NOT_IMPLEMENTED, NOT_IMPLEMENTED]
    assert result.failed_summary() == "not implemented: Toy.answer"
    result = _toy_task().grade(lambda: 1 / 0)
    assert [c.message for c in result.checks] == ["raised ZeroDivisionError: division by zero"] * 2


# ---- extraction ---------------------------------------------------------------------------------
def test_only_the_graded_definitions_and_what_they_need_are_kept():
    cells = ["import pathlib, subprocess, sys\nroot = 1",
             "from collections import deque\n\nLIMIT = 3\n\ndef helper(x):\n    root = x  # a local, not the global\n"
             "    return x\n\nclass Pool:\n    def free(self, b):\n        return helper(deque([LIMIT]))\n",
             "Pool.free = lambda self, b: None\nprint('checks')\nopen('/tmp/x', 'w')"]
    extracted = extract(cells, ALLOCATOR)
    assert extracted.violations == []
    assert [s.source.split("\n")[0] for s in extracted.statements] == [
        "from collections import deque", "LIMIT = 3", "def helper(x):", "class Pool:"]
    assert extracted.statements[-1].cell == 2 and extracted.statements[-1].first_line == 9


def test_the_last_definition_of_a_name_wins_as_when_cells_run():
    cells = ["class Pool:\n    def free(self, b):\n        return 1", "class Pool:\n    def free(self, b):\n        return 2"]
    [statement] = extract(cells, ALLOCATOR).statements
    assert statement.cell == 2


def test_kept_definitions_show_their_source_as_triton_jit_needs_to_compile_them():
    cells = ["x = 1", "import math\n\nclass Pool:\n    def free(self, b):\n        return math.floor(b)\n\ndef kernel(x):\n    return x + 1"]
    namespace = {}
    load(extract(cells, Rules(needs=("Pool", "kernel"), own_methods=("free",))).statements, namespace)
    assert inspect.getsource(namespace["kernel"]) == "def kernel(x):\n    return x + 1\n"
    assert inspect.getsource(namespace["Pool"].free) == "    def free(self, b):\n        return math.floor(b)\n"
    assert inspect.getsourcefile(namespace["kernel"]) == "<cell 2>"
    jit = pytest.importorskip("triton.runtime.jit")
    assert "return x + 1" in jit.JITFunction(namespace["kernel"]).src  # what a GPU's @triton.jit does


def test_a_notebook_graded_after_another_in_one_process_shows_its_own_source():
    """The in-process grader loads notebook after notebook; a cell of an earlier one, longer than this
    one's, once lent its trailing lines to this one's kernel (seen as ``def kernel`` followed by another
    notebook's indented method)."""
    earlier = ["x = 1", "import math\n\nclass Pool:\n    def free(self, b):\n        return b\n\n\n"
                        "    def host_blocks_needed(self):\n        raise NotImplementedError\n"]
    cells = ["x = 1", "import math\n\nclass Pool:\n    def free(self, b):\n        return math.floor(b)\n\ndef kernel(x):\n    return x + 1"]
    InProcess("lab02", extract(earlier, Rules(needs=("Pool",))).statements)
    graded = InProcess("lab02", extract(cells, Rules(needs=("Pool", "kernel"))).statements)
    assert inspect.getsource(graded.namespace["kernel"]) == "def kernel(x):\n    return x + 1\n"


@pytest.mark.parametrize("source, why", [
    ("from kvlib.block_allocator import BlockAllocator\nclass Pool(BlockAllocator):\n    def free(self, b): pass",
     "imports BlockAllocator from kvlib.block_allocator"),
    ("from kvlib.block_allocator import BlockAllocator\nPool = BlockAllocator", "imports BlockAllocator"),
    ("import kvlib.block_allocator as impl\nclass Pool:\n    def free(self, b):\n        return impl.BlockAllocator(4)",
     "imports kvlib.block_allocator"),
    ("class Pool:\n    def free(self, b):\n        return __import__('kvlib').block_allocator", "uses __import__"),
    ("import importlib\nclass Pool:\n    def free(self, b):\n        importlib.import_module('kvlib')", "imports importlib"),
    ("import torch\nclass Pool:\n    def free(self, b):\n        torch.sys.modules['x']", "reaches .sys"),
    ("class Pool:\n    def free(self, b):\n        return self.__class__.__mro__", "reaches __class__"),
    ("from kvlib.course.grading import lab02\nclass Pool:\n    lab02.expect = print\n    def free(self, b): pass",
     "imports lab02 from kvlib.course.grading"),
    ("class Base:\n    def free(self, b): pass\nclass Pool(Base):\n    pass", "must define free itself"),
    ("class Pool(dict):\n    def free(self, b):\n        return super().free(b)", "calls super().free"),
    ("from kvlib.block_allocator import AllocStatus as Base\nclass Pool:\n    def free(self, b):\n        return Base.free(self, b)",
     "calls kvlib's own Base.free"),
])
def test_code_that_reaches_kvlibs_implementation_or_around_the_grader_is_refused(source, why):
    violations = extract([source], ALLOCATOR).violations
    assert any(why in v for v in violations), violations


def test_a_missing_name_or_a_broken_cell_is_reported():
    assert "defines no Pool" in extract(["x = 1"], ALLOCATOR).violations[0]
    assert "code cell 1 does not parse" in extract(["def f(:"], ALLOCATOR).violations[0]
    assert extract(["%matplotlib inline\n!ls\nclass Pool:\n    def free(self, b): pass"], ALLOCATOR).violations == []


# ---- the sandbox --------------------------------------------------------------------------------
def _statements(source: str):
    return extract([source], Rules(needs=("MyBlockAllocator",))).statements


def test_cells_are_parsed_one_at_a_time_as_threads_grading_a_class_need(monkeypatch):
    """CPython 3.11's ``ast.parse`` fails now and then when two threads parse at once (a class graded
    with ``jobs=2`` lost a submission to "AST constructor recursion depth mismatch")."""
    parse, running, most = ast.parse, [0], [0]

    def slow_parse(source, *args, **kwargs):
        running[0] += 1
        most[0] = max(most[0], running[0])
        time.sleep(0.02)
        running[0] -= 1
        return parse(source, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", slow_parse)
    cells = ["def Pool():\n    return 1\n", "x = 2\n"] * 3
    threads = [threading.Thread(target=extract, args=(cells, Rules(needs=("Pool",)))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1


def test_an_unreadable_submission_keeps_the_gradebook_columns(tmp_path):
    (tmp_path / "lab02_truncated.ipynb").write_text('{"cells": [')
    (tmp_path / "homework.ipynb").write_text("{}")
    reports = {r.notebook.name: r for r in grade_folder(tmp_path)}
    truncated = reports["lab02_truncated.ipynb"]
    assert (truncated.points, truncated.max_points) == (0, 20)
    assert {t.task for t in truncated.tasks} == {"allocator", "block_table", "engine"}
    assert truncated.notes[0].startswith("could not be graded:"), truncated.table()
    assert "pass --lab" in reports["homework.ipynb"].notes[0]
    rows = {row["submission"]: row for row in csv.DictReader(write_gradebook(list(reports.values()),
                                                                             tmp_path / "gradebook.csv").open())}
    assert set(rows) == {"lab02_truncated.ipynb", "homework.ipynb"}
    assert rows["lab02_truncated.ipynb"]["allocator"] == "0" and rows["lab02_truncated.ipynb"]["max"] == "20"
    assert rows["homework.ipynb"]["lab"] == "?" and rows["homework.ipynb"]["total"] == "0"


def test_a_hang_costs_one_check_and_the_next_check_still_runs():
    source = ("import time\nclass MyBlockAllocator:\n    def __init__(self, n):\n        if n == 16:\n"
              "            while True: time.sleep(0.1)\n        self.num_blocks = n\n")
    with Sandbox("lab02", _statements(source), Limits(check_scale=0.05)) as sandbox:
        hung = sandbox.run("allocator", "allocate_unique", 2, limit_s=120)
        after = sandbox.run("allocator", "free_returns_block", 2, limit_s=120)
    assert hung.status == TIMED_OUT and "still running after 6 s" in hung.message
    assert after.status == FAIL  # a fresh process graded the next check


def test_a_crash_or_a_definition_that_raises_is_reported_per_check():
    with Sandbox("lab02", _statements("import torch\nclass MyBlockAllocator:\n    def __init__(self, n):\n"
                                      "        torch.empty(2**40)\n")) as sandbox:
        crashed = sandbox.run("allocator", "allocate_unique", 2, limit_s=60)
    assert crashed.status in (FAIL, CRASHED) and "memory" in crashed.message.lower()
    with Sandbox("lab02", _statements("class MyBlockAllocator:\n    x = 1 / 0\n")) as sandbox:
        result = sandbox.run("allocator", "allocate_unique", 2, limit_s=60)
    assert result.status == CRASHED and "ZeroDivisionError" in result.message


# ---- whole notebooks, as `kvlib grade` runs them ------------------------------------------------
def submission(directory: Path, name: str, edits=(), extra_cells=(), base: Path = SOLUTION) -> Path:
    """A learner's notebook: ``base`` without hidden tests, ``edits`` applied, ``extra_cells`` appended."""
    nb = nbformat.read(base, as_version=4)
    for cell in nb.cells:
        cell.source = remove_hidden_tests(cell.source)
    for old, new in edits:
        cells = [c for c in nb.cells if c.cell_type == "code" and old in c.source]
        assert len(cells) == 1 and cells[0].source.count(old) == 1, f"{old!r} must occur once in the notebook"
        cells[0].source = cells[0].source.replace(old, new)
    nb.cells += [nbformat.v4.new_code_cell(source) for source in extra_cells]
    path = directory / name
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The solution, the untouched lab and the forged notebooks, graded as one class would be."""
    folder = tmp_path_factory.mktemp("class")
    submission(folder, "lab02_solution.ipynb")
    submission(folder, "lab02_untouched.ipynb", base=LAB)
    forged = {
        "rewrites_a_score_file": ["import json, os\nopen(os.environ.get('KVLIB_SCORE_FILE', 'scores.json'), 'w')"
                                  ".write(json.dumps([{'task': 'allocator', 'checks': []}]))"],
        "patches_the_grader": ["from kvlib.course.grading import checks, lab02\n"
                               "checks.Task.run_check = lambda self, check, piece: None\nlab02.expect = lambda *a: None"],
        "drops_the_metadata": ["import IPython"],
    }
    for name, cells in forged.items():
        submission(folder, f"lab02_{name}.ipynb", base=LAB, extra_cells=cells)
    delegating = {
        "subclasses_kvlib": ("class MyBlockAllocator:", "from kvlib.block_allocator import BlockAllocator\n\n"
                                                        "class MyBlockAllocator(BlockAllocator):"),
        "aliases_kvlib": ("class MyBlockTable:", "from kvlib.block_table import BlockTable\nMyBlockTable = BlockTable\n\n"
                                                 "class NotUsed:"),
    }
    for name, edit in delegating.items():
        submission(folder, f"lab02_{name}.ipynb", edits=[edit])
    submission(folder, "lab02_hangs_forever.ipynb", edits=[
        ('        """NEVER if the blocks could never fit above the watermark, OK if they fit now, else LATER."""\n',
         '        """NEVER if the blocks could never fit above the watermark, OK if they fit now, else LATER."""\n'
         '        while True:\n            pass\n')])
    graded = grade_folder(folder, jobs=2, limits=Limits(check_scale=0.1))
    gradebook = write_gradebook(graded, folder / "gradebook.csv")
    return {r.notebook.stem.removeprefix("lab02_"): r for r in graded}, gradebook


def test_the_solution_gets_full_marks(reports):
    report = reports[0]["solution"]
    assert report.full_marks, report.table()
    assert [(t.task, t.points) for t in report.tasks] == [("allocator", 10), ("block_table", 5), ("engine", 5)]


def test_the_untouched_lab_gets_zero_and_says_not_implemented(reports):
    report = reports[0]["untouched"]
    assert (report.points, report.max_points) == (0, 20)
    for task in report.tasks:
        assert task.failed_summary().startswith("not implemented: MyBlock"), report.table()


@pytest.mark.parametrize("name", ["rewrites_a_score_file", "patches_the_grader", "drops_the_metadata"])
def test_a_forged_notebook_gets_zero(reports, name):
    report = reports[0][name]
    assert report.points == 0 and report.max_points == 20, report.table()


@pytest.mark.parametrize("name, task", [("subclasses_kvlib", "allocator"), ("aliases_kvlib", "block_table")])
def test_a_task_answered_with_kvlibs_own_implementation_scores_zero(reports, name, task):
    report = reports[0][name]
    graded = report.task(task)
    assert graded.points == 0 and {c.status for c in graded.checks} == {NOT_ALLOWED}, report.table()
    assert "may not use kvlib's" in graded.checks[0].message
    others = [t for t in report.tasks if t.task != task and not (task == "allocator" and t.task == "engine")]
    assert all(t.full_marks for t in others), report.table()


def test_a_hostile_submission_costs_only_its_own_checks(reports):
    graded, gradebook = reports
    hangs = graded["hangs_forever"]
    timed_out = {f"{t.task}/{c.name}" for t in hangs.tasks for c in t.checks if c.status == TIMED_OUT}
    assert timed_out == {"allocator/watermark", "engine/shares_blocks", "engine/serves_under_pressure"}, hangs.table()
    assert hangs.points == 20 - 2 - 5
    rows = {row["submission"]: row for row in csv.DictReader(gradebook.open())}
    assert rows["lab02_solution.ipynb"]["total"] == "20" and rows["lab02_untouched.ipynb"]["total"] == "0"
    assert rows["lab02_hangs_forever.ipynb"]["block_table"] == "5" and rows["lab02_hangs_forever.ipynb"]["total"] == "13"
    assert set(rows) == {f"{p.name}" for p in gradebook.parent.glob("*.ipynb")}


def test_the_lab_comes_from_the_grader_not_from_the_notebook(tmp_path):
    assert lab_of("submissions/lab02_ada_lovelace.ipynb") == "lab02"
    with pytest.raises(ValueError, match="pass --lab"):
        lab_of("homework.ipynb")
    path = submission(tmp_path, "homework.ipynb")
    nb = json.loads(path.read_text())
    nb["metadata"]["kvlib"] = {"lab": "lab99"}  # editable metadata plays no part
    path.write_text(json.dumps(nb))
    assert grade_notebook(path, lab="lab02", limits=Limits()).full_marks


def test_the_table_says_what_failed_and_why(tmp_path):
    path = submission(tmp_path, "lab02_bug.ipynb", edits=[("        return max(0, needed - len(self.blocks))\n",
                                                           "        return needed - len(self.blocks)\n")])
    report = grade_notebook(path)
    assert report.failed_checks() == {"block_table/missing_blocks"} and report.points == 18
    table = report.table()
    assert "block_table/missing_blocks: a table holding 2 blocks" in table and "hint:" in table
    assert "as saved at" in table  # unsaved edits are not graded, and the table says so
    assert all(c.status == PASS for t in report.tasks for c in t.checks if c.name != "missing_blocks")


def test_grading_from_inside_the_notebook_warns_about_unsaved_edits(tmp_path, monkeypatch, capsys):
    import os
    import time

    from kvlib.course.grading.runner import grade_here, mark_cell_run
    path = submission(tmp_path, "lab02_mine.ipynb", base=LAB)
    os.utime(path, (time.time() - 60, time.time() - 60))  # saved a minute ago ...
    monkeypatch.setenv("JPY_SESSION_NAME", str(path))  # the notebook Jupyter has open
    mark_cell_run()  # ... and a cell ran just now
    grade_here()
    out = capsys.readouterr().out
    assert "save it (Ctrl+S) first" in out
    assert "lab02_mine.ipynb (lab02)" in out and "not implemented" in out
