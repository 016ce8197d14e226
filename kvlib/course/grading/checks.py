"""Graded tasks made of named checks, each worth points, each run on the learner's piece.

A check is a function that raises :class:`CheckFailed` (through :func:`expect`) with a message
saying what went wrong. Grading never lets an exception escape: a stub's NotImplementedError
scores zero as "not implemented" and any other error fails that check only, so one unfinished
task does not stop the notebook or the tasks after it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kvlib.course.grading.record import FAIL, NOT_IMPLEMENTED, NOT_RUN, PASS, CheckResult, TaskResult, record


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


@dataclass
class Task:
    """A graded task: register checks with ``@task.check(points, hint)``, then ``task.grade(piece)``."""

    name: str
    checks: list[Check] = field(default_factory=list)

    def check(self, points: int, hint: str) -> Callable:
        def register(run: Callable[[Any], None]) -> Callable[[Any], None]:
            self.checks.append(Check(run.__name__, points, hint, run))
            return run
        return register

    def grade(self, piece: Any) -> TaskResult:
        """Run every check on ``piece``, print a line per check, record and return the score."""
        result = TaskResult(self.name, [self._run(check, piece) for check in self.checks])
        print(f"{self.name}: {result.points}/{result.max_points} points")
        record(result)
        return result

    def not_run(self, why: str) -> TaskResult:
        """The zero score of a task whose grading cell never finished."""
        return TaskResult(self.name, [CheckResult(c.name, c.points, NOT_RUN, why, c.hint) for c in self.checks])

    def _run(self, check: Check, piece: Any) -> CheckResult:
        try:
            check.run(piece)
        except NotImplementedError as exc:
            result = CheckResult(check.name, check.points, NOT_IMPLEMENTED, str(exc) or "a stub is still in place")
        except CheckFailed as exc:
            result = CheckResult(check.name, check.points, FAIL, str(exc), check.hint)
        except Exception as exc:  # noqa: BLE001 - the learner's bug fails this check only
            result = CheckResult(check.name, check.points, FAIL, f"raised {type(exc).__name__}: {exc}", check.hint)
        else:
            result = CheckResult(check.name, check.points, PASS)
        print(_line(self.name, result))
        return result


def _line(task: str, result: CheckResult) -> str:
    if result.status == PASS:
        return f"PASS {task}/{result.name}"
    reason = result.message if result.status == FAIL else f"{result.status}: {result.message}"
    line = f"FAIL {task}/{result.name}: {reason}"
    return f"{line}\n     hint: {result.hint}" if result.hint else line
