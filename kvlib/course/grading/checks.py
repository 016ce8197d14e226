"""Graded tasks made of named checks, each worth points, each run on the learner's piece.

A check is a function that raises :class:`CheckFailed` (through :func:`expect`) with a message
saying what went wrong. Running a check never lets an exception escape: a stub's
NotImplementedError scores zero as "not implemented" and any other error fails that check only,
with the line of the learner's code that raised, so one unfinished task does not stop the
others. Inside a notebook, ``Task.grade`` gives feedback; the grade itself is computed by
``kvlib grade``, in a process the notebook never controls.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from kvlib.course.grading.extract import Rules
from kvlib.course.grading.results import FAIL, NOT_IMPLEMENTED, PASS, CheckResult, TaskResult

DEFAULT_LIMIT_S = 120.0  # seconds a check may run before the grader stops it


class CheckFailed(AssertionError):
    """The learner's piece gave a wrong answer; the message says which and what was expected."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def expect_raises(error: type[BaseException], action: Callable[[], Any], what: str) -> None:
    """``action()`` must raise ``error``; a NotImplementedError passes through as "not implemented"."""
    try:
        action()
    except NotImplementedError:
        raise
    except error:
        return
    except Exception as exc:  # noqa: BLE001 - the wrong error is a failed check, not a crash
        raise CheckFailed(f"{what} raised {type(exc).__name__}: {exc}, expected {error.__name__}") from exc
    raise CheckFailed(f"{what} did not raise {error.__name__}")


@dataclass
class Check:
    name: str
    points: int
    hint: str
    run: Callable[[Any], None]
    limit_s: float = DEFAULT_LIMIT_S


@dataclass
class Task:
    """A graded task: what it grades (``rules``), and its checks (``@task.check(points, hint)``)."""

    name: str
    rules: Rules
    checks: list[Check] = field(default_factory=list)

    def check(self, points: int, hint: str, limit_s: float = DEFAULT_LIMIT_S) -> Callable:
        def register(run: Callable[[Any], None]) -> Callable[[Any], None]:
            self.checks.append(Check(run.__name__, points, hint, run, limit_s))
            return run
        return register

    def piece(self, namespace: dict) -> Any:
        """What the checks are handed: the one graded name, or a namespace of several."""
        if len(self.rules.needs) == 1:
            return namespace[self.rules.needs[0]]
        return type("Learner", (), {name: namespace[name] for name in self.rules.needs})

    def grade(self, piece: Any) -> TaskResult:
        """Feedback inside the notebook: run every check on ``piece``, print a line per check."""
        result = TaskResult(self.name, [self.run_check(check, piece) for check in self.checks])
        for check in result.checks:
            print(_line(self.name, check))
        print(f"{self.name}: {result.points}/{result.max_points} points")
        return result

    def zero(self, status: str, message: str) -> TaskResult:
        """Every check of the task scored zero for one reason (a violation, a crash)."""
        return TaskResult(self.name, [CheckResult(c.name, c.points, status, message, c.hint) for c in self.checks])

    def run_check(self, check: Check, piece: Any) -> CheckResult:
        try:
            check.run(piece)
        except NotImplementedError as exc:
            return CheckResult(check.name, check.points, NOT_IMPLEMENTED, str(exc) or "a stub is still in place")
        except CheckFailed as exc:
            return CheckResult(check.name, check.points, FAIL, str(exc), check.hint)
        except Exception as exc:  # noqa: BLE001 - the learner's bug fails this check only
            return CheckResult(check.name, check.points, FAIL, f"raised {type(exc).__name__}: {exc}{_where(exc)}",
                               check.hint)
        return CheckResult(check.name, check.points, PASS)


def _where(exc: BaseException) -> str:
    """Where in the learner's code an exception came from, when it did."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f.filename.startswith(("<cell ", "<ipython-input")) or "/ipykernel_" in f.filename]
    if not frames:
        return ""
    cell = f"code {frames[-1].filename.strip('<>')}, " if frames[-1].filename.startswith("<cell ") else ""
    return f" (in {frames[-1].name}, {cell}line {frames[-1].lineno})"


def _line(task: str, result: CheckResult) -> str:
    if result.status == PASS:
        return f"PASS {task}/{result.name}"
    reason = result.message if result.status == FAIL else f"{result.status}: {result.message}"
    line = f"FAIL {task}/{result.name}: {reason}"
    return f"{line}\n     hint: {result.hint}" if result.hint else line
