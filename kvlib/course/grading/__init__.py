"""Graded checks for the labs, and ``kvlib grade``, which scores a notebook where it cannot reach.

Inside a lab notebook a check cell calls e.g. ``lab02.check_allocator(MyBlockAllocator)``: it
prints a PASS or FAIL line per check, for feedback. ``grade_notebook`` computes the grade: it
extracts the learner's definitions from the notebook file (running none of its cells), runs each
check's scenario on them in an isolated process that holds no answer, and compares what it saw
with kvlib's own piece on the same inputs, in the grader's process.
"""
from kvlib.course.grading.checks import CheckFailed, Task, close, expect, expect_raises, raised, same
from kvlib.course.grading.report import GradeReport
from kvlib.course.grading.results import CheckResult, TaskResult

__all__ = ["CheckFailed", "CheckResult", "GradeReport", "Task", "TaskResult", "close", "expect", "expect_raises",
           "raised", "same", "grade_notebook", "grade_folder", "grade_here"]


def __getattr__(name: str):
    # The runner starts processes and reads notebooks; check cells inside a notebook never need it.
    if name in ("grade_notebook", "grade_folder", "grade_here"):
        from kvlib.course.grading import runner
        return getattr(runner, name)
    raise AttributeError(f"module 'kvlib.course.grading' has no attribute {name!r}")
