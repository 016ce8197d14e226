"""Graded checks for the labs, and ``kvlib grade``, which scores a notebook where it cannot reach.

Inside a lab notebook a check cell calls e.g. ``lab02.check_allocator(MyBlockAllocator)``: it
prints a PASS or FAIL line per check, for feedback. ``grade_notebook`` computes the grade: it
extracts the learner's definitions from the notebook file (running none of its cells) and runs
each check on them in a separate process with a time and memory limit.
"""
from kvlib.course.grading.checks import CheckFailed, Task, expect, expect_raises
from kvlib.course.grading.report import GradeReport
from kvlib.course.grading.results import CheckResult, TaskResult

__all__ = ["CheckFailed", "CheckResult", "GradeReport", "Task", "TaskResult", "expect", "expect_raises",
           "grade_notebook", "grade_folder", "grade_here"]


def __getattr__(name: str):
    # The runner starts processes and reads notebooks; check cells inside a notebook never need it.
    if name in ("grade_notebook", "grade_folder", "grade_here"):
        from kvlib.course.grading import runner
        return getattr(runner, name)
    raise AttributeError(f"module 'kvlib.course.grading' has no attribute {name!r}")
