"""Graded tasks as tables of checks: a scenario that observes the learner's piece, and the points it is worth.

A check's scenario runs the piece on inputs drawn from a seed and returns what it saw (an
*observation*: numbers, strings, lists and dicts of them). The grader runs the same scenario on
kvlib's own piece (the task's ``reference``) in its own process, and the check passes only when the
two observations agree under the check's comparison. The learner's process therefore never decides
a grade: it hands back data, and a scenario that cannot see the answer cannot fake it. A scenario
may also fail on its own (:func:`expect`, e.g. a broken invariant), which can only cost points.

``Task.grade`` gives the same verdicts as feedback inside a notebook, with seed 0; ``kvlib grade``
draws a fresh seed, so code fitted to the feedback's cases does not pass for that reason.
"""
from __future__ import annotations

import math
import random
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kvlib.course.grading import reach_rule
from kvlib.course.grading.results import FAIL, NOT_IMPLEMENTED, PASS, CheckResult, TaskResult

DEFAULT_LIMIT_S = 60.0  # seconds a check may run in the sandbox before the grader stops it
FEEDBACK_SEED = 0

Scenario = Callable[[Any, random.Random], Any]
Compare = Callable[[Any, Any], Optional[str]]  # (yours, kvlib's) -> None when they agree, else why not


class CheckFailed(AssertionError):
    """The learner's piece did something no correct piece does; the message says what."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def expect_raises(error: type[BaseException], action: Callable[[], Any], what: str) -> None:
    """``action()`` must raise ``error``; a NotImplementedError passes through as "not implemented"."""
    got = raised(action)
    if got != error.__name__:
        raise CheckFailed(f"{what} raised {got}, expected {error.__name__}" if got else f"{what} did not raise "
                          f"{error.__name__}")


def raised(action: Callable[[], Any]) -> Optional[str]:
    """The name of the exception ``action()`` raised, or None: an observation of how a piece refuses."""
    try:
        action()
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - which error it was is what is observed
        return type(exc).__name__
    return None


# ---- comparing observations ---------------------------------------------------------------------
def same(yours: Any, reference: Any, path: str = "") -> Optional[str]:
    """Exact agreement, key by key; the message names the first observation that differs."""
    return _walk(yours, reference, path, _exactly)


def close(atol: float, rtol: float) -> Compare:
    """Agreement of nested lists of floats within ``atol + rtol * |kvlib's|``, other values exactly."""
    def within(yours: Any, reference: Any, path: str) -> Optional[str]:
        theirs = _flat(reference) if isinstance(reference, list) else None
        if not theirs:
            return _exactly(yours, reference, path)
        where = path or "result"
        mine = _flat(yours)
        if mine is None or len(mine) != len(theirs):
            return f"{where}: yours has another shape than kvlib's ({_short(yours)})"
        if any(math.isnan(a) != math.isnan(b) for a, b in zip(mine, theirs)):
            return f"{where}: yours holds NaN where kvlib's does not"
        off = [abs(a - b) for a, b in zip(mine, theirs) if not abs(a - b) <= atol + rtol * abs(b)]
        if off:
            return (f"{where}: {len(off)} of {len(theirs)} values differ from kvlib's, by up to {max(off):.3g} "
                    f"(allowed {atol:g} + {rtol:g} x |value|)")
        return None
    return lambda yours, reference, path="": _walk(yours, reference, path, within)


def _walk(yours: Any, reference: Any, path: str, leaf: Callable[[Any, Any, str], Optional[str]]) -> Optional[str]:
    """Compare dicts key by key (kvlib's keys, in order), everything else with ``leaf``."""
    if isinstance(reference, dict) and isinstance(yours, dict):
        for key, expected in reference.items():
            why = _walk(yours[key], expected, _at(path, key), leaf) if key in yours else \
                f"{_at(path, key)}: nothing observed"
            if why:
                return why
        return None
    return leaf(yours, reference, path)


def _exactly(yours: Any, reference: Any, path: str) -> Optional[str]:
    if not _equal(yours, reference):
        first = next((i for i, (a, b) in enumerate(zip(yours, reference)) if not _equal(a, b)), None) \
            if isinstance(yours, list) and isinstance(reference, list) and len(yours) == len(reference) else None
        if first is not None and len(repr(reference)) > SHORT:  # too long to read whole: where they part
            return _exactly(yours[first], reference[first], f"{path or 'result'}, item {first} of {len(reference)}")
        return f"{path or 'result'}: yours is {_short(yours)}, kvlib's is {_short(reference)}"
    return None


def _equal(yours: Any, reference: Any) -> bool:
    return yours == reference and (type(yours) is type(reference) or _both_numbers(yours, reference))


def _at(path: str, key: Any) -> str:
    return f"{path}, {key}" if path else str(key)


def _both_numbers(a: Any, b: Any) -> bool:
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
        and not isinstance(b, bool)


def _flat(value: Any) -> Optional[list[float]]:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, list):
        out: list[float] = []
        for item in value:
            inner = _flat(item)
            if inner is None:
                return None
            out += inner
        return out
    return None


SHORT = 160  # characters of an observation a message shows


def _short(value: Any, limit: int = SHORT) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ...]"


# ---- tasks and checks ---------------------------------------------------------------------------
@dataclass
class Check:
    name: str
    points: int
    hint: str
    scenario: Scenario
    compare: Compare = same
    limit_s: float = DEFAULT_LIMIT_S


@dataclass
class Task:
    """A graded task: the names it grades, what the grading sandbox hides, the reference, and its checks.

    ``hidden`` lists kvlib's own answer to the task (``"module:Qualname"``, a class, a method or a
    function, or ``"module:*"`` for a whole module): in the sandbox's copy of kvlib each is a stub that
    raises NotImplementedError, and so it is while the notebook's feedback runs the learner's code.
    ``reference`` builds kvlib's own piece, in the grader's process only.
    """

    name: str
    needs: tuple[str, ...]
    hidden: tuple[str, ...]
    reference: Callable[[], Any]
    checks: list[Check] = field(default_factory=list)
    decisions: Any = None  # a Decisions: the sandbox sends what the piece decided, the grader measures it
    rule: Optional[Callable[[list], list[str]]] = None  # the graded statements -> what breaks the task's rule

    def check(self, points: int, hint: str, compare: Compare = same, limit_s: float = DEFAULT_LIMIT_S) -> Callable:
        """Register the decorated scenario as a check named after it."""
        def register(scenario: Scenario) -> Scenario:
            self.add(scenario.__name__, points, hint, scenario, compare, limit_s)
            return scenario
        return register

    def add(self, name: str, points: int, hint: str, scenario: Scenario, compare: Compare = same,
            limit_s: float = DEFAULT_LIMIT_S) -> None:
        """Register ``scenario`` as the check ``name``: for checks made from a table's rows."""
        self.checks.append(Check(name, points, hint, scenario, compare, limit_s))

    def breaches(self, statements: list) -> list[str]:
        """What in the graded statements breaks every lab's rule (``reach_rule``) or this task's own."""
        return reach_rule.reaches(statements) + (self.rule(statements) if self.rule is not None else [])

    def named(self, check: str) -> Check:
        return next(c for c in self.checks if c.name == check)

    def piece(self, namespace: dict) -> Any:
        """What the scenarios are handed: the one graded name, or a namespace of several."""
        if len(self.needs) == 1:
            return namespace[self.needs[0]]
        return type("Learner", (), {name: namespace[name] for name in self.needs})

    def grade(self, piece: Any) -> TaskResult:
        """Feedback inside the notebook: every check on ``piece`` against kvlib's own, a line per check."""
        for breach in self.breaches(reach_rule.source_of(piece)):
            print(f"FAIL {self.name}: when graded, every check of this task fails: {breach}")
        result = TaskResult(self.name, self.verdicts(piece, FEEDBACK_SEED))
        for check in result.checks:
            print(_line(self.name, check))
        print(f"{self.name}: {result.points}/{result.max_points} points")
        return result

    def verdicts(self, piece: Any, seed: int) -> list[CheckResult]:
        """Every check on ``piece`` against kvlib's own, both in this process (kvlib's answer hidden while
        ``piece`` runs), as the grader would decide them on ``seed``."""
        from kvlib.course.grading.decisions import decided, measured
        from kvlib.course.grading.hidden import hiding

        results = []
        for check in self.checks:
            reference = observe(check, self.reference(), seed)
            with hiding(self.hidden):
                seen = decided(self, check, piece, seed)
            results.append(verdict(check, measured(self, check, seen, seed), reference))
        return results

    def zero(self, status: str, message: str) -> TaskResult:
        """Every check of the task scored zero for one reason (a missing name, a crash)."""
        return TaskResult(self.name, [CheckResult(c.name, c.points, status, message, c.hint) for c in self.checks])


@dataclass(frozen=True)
class Observed:
    """What one scenario run gave: an observation, or why there is none (``status`` is FAIL or NOT_IMPLEMENTED)."""

    status: str  # "observed", FAIL, NOT_IMPLEMENTED
    observation: Any = None
    message: str = ""


def observe(check: Check, piece: Any, seed: int) -> Observed:
    """Run ``check``'s scenario on ``piece``; never lets an exception escape."""
    try:
        return Observed("observed", check.scenario(piece, random.Random(seed)))
    except NotImplementedError as exc:
        return Observed(NOT_IMPLEMENTED, message=str(exc) or "a stub is still in place")
    except CheckFailed as exc:
        return Observed(FAIL, message=str(exc))
    except Exception as exc:  # noqa: BLE001 - the learner's bug fails this check only
        return Observed(FAIL, message=f"raised {type(exc).__name__}: {exc}{_where(exc)}")
    except SystemExit as exc:  # it would end the process running the checks, and every later check with it
        return Observed(FAIL, message=f"raised SystemExit({exc.code!r}){_where(exc)}: exit() or sys.exit() ends the "
                                      f"process the checks run in; return, or raise an error, instead")


def verdict(check: Check, yours: Observed, reference: Observed) -> CheckResult:
    """The grader's decision for one check, from the two observations."""
    if reference.status != "observed":
        raise RuntimeError(f"the grader's own check {check.name} fails on kvlib's piece: {reference.message}")
    if yours.status != "observed":
        return CheckResult(check.name, check.points, yours.status, yours.message,
                           check.hint if yours.status == FAIL else "")
    why = check.compare(yours.observation, reference.observation)
    if why:
        return CheckResult(check.name, check.points, FAIL, why, check.hint)
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
    line = f"FAIL {task}/{result.name}: {result.reason}"
    return f"{line}\n     hint: {result.hint}" if result.hint else line
