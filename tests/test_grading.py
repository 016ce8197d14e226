"""Graded checks: full marks for a correct piece, zero for a stub, and a bug costs exactly its checks.

Most cases grade classes in this process (fast). A few grade whole notebooks the way
``kvlib grade`` does: the solution, the untouched lab, and two buggy copies of the solution.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from kvlib.block_allocator import BlockAllocator, BlockAllocatorError
from kvlib.block_table import BlockTable
from kvlib.course.grading import GradeReport, Task, TaskResult, expect, grade_notebook, lab02, runner
from kvlib.course.grading.record import FAIL, NOT_IMPLEMENTED, PASS, SCORE_FILE_ENV, CheckResult, read_scores
from kvlib.course.grading.report import CellError
from kvlib.course.labs import remove_hidden_tests

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab02_allocator.ipynb"
LAB = ROOT / "labs" / "lab02_allocator.ipynb"


# ---- the framework -----------------------------------------------------------------------------
def _toy_task() -> Task:
    task = Task("toy")

    @task.check(2, "return 4")
    def answer(fn):
        expect(fn() == 4, f"got {fn()}")

    @task.check(1, "do not crash")
    def runs(fn):
        fn()
    return task


def test_a_task_prints_a_line_per_check_and_records_its_score(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(SCORE_FILE_ENV, str(tmp_path / "scores.json"))
    result = _toy_task().grade(lambda: 5)
    assert (result.points, result.max_points) == (1, 3)
    assert capsys.readouterr().out == "FAIL toy/answer: got 5\n     hint: return 4\nPASS toy/runs\ntoy: 1/3 points\n"
    assert read_scores(tmp_path / "scores.json") == {"toy": result}


def test_a_stub_scores_zero_as_not_implemented_and_other_errors_fail_one_check(monkeypatch):
    monkeypatch.delenv(SCORE_FILE_ENV, raising=False)

    def stub():
        raise NotImplementedError("Toy.answer")
    result = _toy_task().grade(stub)
    assert [c.status for c in result.checks] == [NOT_IMPLEMENTED, NOT_IMPLEMENTED]
    assert result.failed_summary() == "not implemented: Toy.answer"
    result = _toy_task().grade(lambda: 1 / 0)
    assert [c.message for c in result.checks] == ["raised ZeroDivisionError: division by zero"] * 2
    assert result.failed_summary() == "answer, runs"


def test_report_table_lists_tasks_failed_checks_hints_and_cell_errors():
    failed = CheckResult("refcount", 2, FAIL, "ref_count is 2, expected 1", "free drops one owner")
    report = GradeReport(Path("lab.ipynb"), [TaskResult("allocator", [CheckResult("allocate_unique", 2, PASS), failed]),
                                             _toy_task().not_run("its grading cell did not finish")],
                         [CellError(4, "NameError: name 'MyBlockTable' is not defined")])
    assert not report.full_marks
    assert report.failed_checks() == {"allocator/refcount", "toy/answer", "toy/runs"}
    assert report.table() == """lab.ipynb
task       points  max  failed checks
allocator       2    4  refcount
toy             0    3  not run: its grading cell did not finish
total           2    7

failed checks:
  allocator/refcount: ref_count is 2, expected 1
    hint: free drops one owner

cells that raised an error:
  cell 4: NameError: name 'MyBlockTable' is not defined"""


# ---- lab 02 checks on classes ------------------------------------------------------------------
def test_the_reference_pieces_get_full_marks():
    assert lab02.check_allocator(BlockAllocator).full_marks
    assert lab02.check_block_table(BlockTable).full_marks
    assert lab02.check_engine(BlockAllocator).full_marks


class LeakyFree(BlockAllocator):
    def free(self, block_id):  # forgets to drop the owner, so the block never comes back
        self._check_owned(block_id, "free")
        if self._ref_counts[block_id] == 0:
            self._free.append(block_id)


class IgnoresWatermark(BlockAllocator):
    def can_allocate(self, num_blocks, watermark_blocks=0):
        return super().can_allocate(num_blocks, 0)


class NoRangeCheck(BlockAllocator):
    def _check_owned(self, block_id, action):  # an id past the pool raises IndexError, not BlockAllocatorError
        if self._ref_counts[block_id] == 0:
            raise BlockAllocatorError(f"cannot {action} free block {block_id}")


class SlotWithoutScale(BlockTable):
    def slot(self, position):
        block_index, offset = divmod(position, self.block_size)
        return self.blocks[block_index] + offset


class CountsNegative(BlockTable):
    def num_missing_blocks(self, num_tokens):
        return -(-num_tokens // self.block_size) - len(self.blocks)


class PopTailNegativeZero(BlockTable):
    def pop_tail(self, count):
        taken = self.blocks[-count:]
        del self.blocks[-count:]
        return taken


@pytest.mark.parametrize("check, piece, failed", [
    (lab02.check_allocator, LeakyFree, ["free_returns_block", "refcount", "double_free_raises", "random_workload"]),
    (lab02.check_allocator, IgnoresWatermark, ["watermark"]),
    (lab02.check_allocator, NoRangeCheck, ["double_free_raises"]),
    (lab02.check_block_table, SlotWithoutScale, ["slot_mapping"]),
    (lab02.check_block_table, CountsNegative, ["missing_blocks"]),
    (lab02.check_block_table, PopTailNegativeZero, ["pop_tail"]),
])
def test_a_bug_costs_exactly_the_checks_that_cover_it(check, piece, failed):
    result = check(piece)
    assert [c.name for c in result.failed] == failed
    assert all(c.status == FAIL and c.hint for c in result.failed)


def test_every_solution_names_a_grading_module_with_tasks():
    for solution in sorted((ROOT / "solutions").glob("lab*.ipynb")):
        assert runner.lab_tasks(nbformat.read(solution, as_version=4)), f"{solution.name}: no kvlib.lab metadata"


# ---- whole notebooks, as `kvlib grade` runs them -----------------------------------------------
def _variant(tmp_path_factory, name: str, edits: list[tuple[str, str]]) -> Path:
    """A learner's lab 02: the solution without hidden tests, each ``old`` text (present once) replaced by ``new``."""
    nb = nbformat.read(SOLUTION, as_version=4)
    for cell in nb.cells:
        cell.source = remove_hidden_tests(cell.source)
    for old, new in edits:
        cells = [c for c in nb.cells if old in c.source]
        assert len(cells) == 1 and cells[0].source.count(old) == 1, f"{old!r} must occur once in the solution"
        cells[0].source = cells[0].source.replace(old, new)
    path = tmp_path_factory.mktemp(name) / SOLUTION.name
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def solution_report() -> GradeReport:
    return grade_notebook(SOLUTION)


@pytest.fixture(scope="module")
def lab_report() -> GradeReport:
    return grade_notebook(LAB)


@pytest.fixture(scope="module")
def leaky_free_report(tmp_path_factory) -> GradeReport:
    return grade_notebook(_variant(tmp_path_factory, "leaky", [("        self._ref_counts[block_id] -= 1\n", "")]))


@pytest.fixture(scope="module")
def watermark_and_typo_report(tmp_path_factory) -> GradeReport:
    return grade_notebook(_variant(tmp_path_factory, "typo", [
        ("if num_blocks > self.num_blocks - watermark_blocks:", "if num_blocks > self.num_blocks:"),
        ("if self.num_free - num_blocks >= watermark_blocks:", "if self.num_free >= num_blocks:"),
        ("def slot(self, position: int) -> int:", "def slot(self, position: int) -> int"),
    ]))


def test_the_solution_gets_full_marks(solution_report):
    assert solution_report.full_marks, solution_report.table()
    assert [(t.task, t.points) for t in solution_report.tasks] == [("allocator", 10), ("block_table", 5), ("engine", 5)]
    assert solution_report.errors == []


def test_the_untouched_lab_gets_zero_and_says_not_implemented(lab_report):
    assert lab_report.points == 0 and lab_report.max_points == 20
    assert lab_report.errors == [], "a lab must run to the end with its stubs"
    table = lab_report.table()
    for task in ("allocator", "block_table", "engine"):
        assert lab_report.task(task).failed_summary().startswith("not implemented: MyBlock"), table


def test_free_without_dropping_the_owner_loses_exactly_the_checks_that_free(leaky_free_report):
    assert leaky_free_report.failed_checks() == {"allocator/free_returns_block", "allocator/refcount",
                                                 "allocator/double_free_raises", "allocator/random_workload",
                                                 "engine/serves_requests"}
    assert leaky_free_report.points == 9
    assert "allocator/refcount: after 2 forks and 1 free" in leaky_free_report.table()


def test_a_broken_cell_zeroes_its_task_and_the_other_tasks_still_score(watermark_and_typo_report):
    report = watermark_and_typo_report
    assert report.failed_checks() == {"allocator/watermark", "block_table/slot_mapping",
                                      "block_table/missing_blocks", "block_table/pop_tail"}
    assert report.task("engine").full_marks and report.points == 13
    assert report.task("block_table").failed_summary().startswith("not run: its grading cell did not finish")
    assert [e.error.split(":")[0] for e in report.errors] == ["SyntaxError", "NameError"]


def test_an_overrunning_cell_is_interrupted_and_a_dead_kernel_is_reported(tmp_path):
    cells = [nbformat.v4.new_code_cell("while True: pass"), nbformat.v4.new_code_cell("import os; os._exit(1)")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata={"kvlib": {"lab": "lab02"}}), tmp_path / "crash.ipynb")
    report = grade_notebook(tmp_path / "crash.ipynb", timeout=2)
    assert report.points == 0 and report.failed_checks() == {f"{t.name}/{c.name}" for t in lab02.TASKS for c in t.checks}
    assert report.errors == [CellError(1, "ran past the time limit of 2 s per cell and was interrupted"),
                             CellError(2, "the kernel died (a crash, or out of memory); later cells did not run")]
