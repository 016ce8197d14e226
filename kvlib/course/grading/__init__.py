"""Graded checks for the labs, and ``kvlib grade``, which runs a notebook and scores it.

Inside a lab notebook a check cell calls e.g. ``kvlib.course.grading.lab02.check_allocator(MyBlockAllocator)``:
it prints a PASS or FAIL line per check and records the task's score. ``grade_notebook`` runs
the whole notebook in a fresh kernel and returns the score table.
"""
from kvlib.course.grading.checks import CheckFailed, Task, expect, expect_raises
from kvlib.course.grading.record import CheckResult, TaskResult
from kvlib.course.grading.report import GradeReport

__all__ = ["CheckFailed", "CheckResult", "GradeReport", "Task", "TaskResult", "expect", "expect_raises",
           "grade_notebook"]


def __getattr__(name: str):
    # The runner imports nbformat and nbclient (about a second); check cells inside a notebook never need them.
    if name == "grade_notebook":
        from kvlib.course.grading.runner import grade_notebook
        return grade_notebook
    raise AttributeError(f"module 'kvlib.course.grading' has no attribute {name!r}")
