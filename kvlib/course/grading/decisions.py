"""Checks that take the learner's decisions from the sandbox and measure them in the grader.

A check whose comparison is one-sided ("costs no more than kvlib's") or whose observation is the
same for every correct answer can be passed by forging the observation: the scenario runs in the
sandbox after the learner's code has loaded, and that code can rewrite it. For such tasks the
sandbox sends back only what the learner's piece decided, call by call (which candidate, which
warning), as plain data. The grader then runs the scenario itself, on its own inputs, with a piece
of its own that answers each call with the learner's recorded decision (:class:`Decisions`), and
measures the outcome. A forged list of decisions is graded as the policy that would make them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from kvlib.course.grading.checks import CheckFailed, Observed, observe
from kvlib.course.grading.results import FAIL

DECIDED = "decided"  # a sandbox's reply that carries decisions, to be measured by the grader


@dataclass(frozen=True)
class Decisions:
    """How a task's piece is recorded in the sandbox and replayed in the grader.

    ``record(piece, log)`` wraps the learner's piece so that every answer it gives is appended to
    ``log`` as JSON data; ``replay(log)`` is the grader's own piece answering the same calls, in the
    same order, with those answers (:class:`Answers` hands them out).
    """

    record: Callable[[Any, list], Any]
    replay: Callable[["Answers"], Any]


class Answers:
    """The recorded decisions, handed out one call at a time; running out is the sandbox's fault."""

    def __init__(self, log: list):
        self.log, self.next = log, 0

    def take(self) -> Any:
        if self.next >= len(self.log):
            raise CheckFailed(f"the sandbox reported {len(self.log)} decisions, but the check asked your piece for "
                              f"more: the reply does not come from the piece the check ran")
        self.next += 1
        return self.log[self.next - 1]


def decided(task, check, piece: Any, seed: int) -> Observed:
    """In the sandbox: the check's scenario on the learner's piece; the reply is what the piece decided."""
    if task.decisions is None:
        return observe(check, piece, seed)
    log: list = []
    seen = observe(check, task.decisions.record(piece, log), seed)
    return Observed(DECIDED, log) if seen.status == "observed" else seen


def measured(task, check, seen: Observed, seed: int) -> Observed:
    """In the grader: the observation of a sandbox's reply, measured here when it carries decisions."""
    if task.decisions is None:
        return seen if seen.status != DECIDED else Observed(FAIL, message="the sandbox sent decisions where this "
                                                                          "check takes an observation")
    if seen.status == "observed":
        return Observed(FAIL, message="the sandbox sent an observation where this check takes your piece's "
                                      "decisions, to measure them here: the reply does not come from the check")
    if seen.status != DECIDED:
        return seen
    if not isinstance(seen.observation, list):
        return Observed(FAIL, message="the sandbox's decisions are not a list")
    return observe(check, task.decisions.replay(Answers(seen.observation)), seed)


class StandIn:
    """What the grader's replayed piece answers where the learner's answered something that is not data:
    it prints as the learner's answer did and is as true or false."""

    def __init__(self, text: str, truthy: bool = True):
        self.text, self.truthy = text, truthy

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__

    def __bool__(self) -> bool:
        return self.truthy


def _wrapping(cls, method: str, answer: Callable) -> type:
    """A class like ``cls`` whose ``method`` goes through ``answer(inner's bound method, *args)``."""
    def __init__(self, *args, **kwargs):
        self.inner = cls(*args, **kwargs)

    def call(self, *args):
        return answer(getattr(self.inner, method), *args)
    return type(getattr(cls, "__name__", "Piece"), (), {"__init__": __init__, method: call})


def _replaying(method: str, answer: Callable) -> type:
    def call(self, *args):
        return answer(*args)
    return type("Replayed", (), {method: call})


def choice_of(method: str) -> Decisions:
    """A class whose ``method(items, ...)`` picks one of ``items``: each pick is recorded as its index."""
    def record(cls, log: list) -> type:
        def pick(bound, items, *args):
            given = list(items)
            chosen = bound(items, *args)
            log.append(next((i for i, item in enumerate(given) if item is chosen), repr(chosen)[:200]))
            return chosen
        return _wrapping(cls, method, pick)

    def replay(answers: Answers) -> type:
        def pick(items, *args):
            index = answers.take()
            listed = isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(items)
            return items[index] if listed else StandIn(str(index))
        return _replaying(method, pick)
    return Decisions(record, replay)


def answer_of(method: str) -> Decisions:
    """A class whose ``method(...)`` returns None, a string or a number: each answer is recorded as it is."""
    def record(cls, log: list) -> type:
        def keep(bound, *args):
            got = bound(*args)
            plain = got is None or type(got) in (str, int, float, bool)
            log.append(got if plain else {"stand_in": repr(got)[:500], "truthy": bool(got)})
            return got
        return _wrapping(cls, method, keep)

    def replay(answers: Answers) -> type:
        def give(*args):
            got = answers.take()
            return StandIn(str(got.get("stand_in")), bool(got.get("truthy"))) if isinstance(got, dict) else got
        return _replaying(method, give)
    return Decisions(record, replay)
