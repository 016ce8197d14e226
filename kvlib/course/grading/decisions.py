"""Checks that take the learner's decisions from the sandbox and measure them in the grader.

A check whose comparison is one-sided ("costs no more than kvlib's") or whose observation is the
same for every correct answer can be passed by forging the observation: the scenario runs in the
sandbox after the learner's code has loaded, and that code can rewrite it. For such tasks the
sandbox sends back only what the learner's piece decided, call by call (which candidate, which
warning, what an allocator answered or raised), as plain data. The grader then runs the scenario
itself, on its own inputs, with a piece of its own that answers each call with the learner's
recorded decision (:class:`Decisions`), and measures the outcome. A forged list of decisions is
graded as the policy that would make them.
"""
from __future__ import annotations

import builtins
import enum
import itertools
import numbers
import operator
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


def calls_to(protocol: type, enums: tuple[type, ...] = (), errors: tuple[type, ...] = ()) -> Decisions:
    """A class whose instances keep ``protocol`` (an allocator): every attribute read and every call's answer, or
    the error it raised, is recorded in the order asked, with the instance and the member, so the grader's instances
    answer the same questions alike and the grader's scenario, engine runs included, measures them. An answer of
    one of ``enums`` is kept by name; an error of ``errors`` (or a builtin one) is raised again by class."""
    from kvlib.interfaces import protocol_members
    members = protocol_members(protocol)
    methods = {name for name in members if callable(getattr(protocol, name, None))}
    by_name = {cls.__name__: cls for cls in (*enums, *errors)}

    def record(cls, log: list) -> type:
        numbers_given = itertools.count()

        class Recorded:
            def __init__(self, *args, **kwargs):
                self.inner, self.number = cls(*args, **kwargs), next(numbers_given)

            def __getattr__(self, name: str):
                if name not in members:
                    raise AttributeError(name)
                if name in methods:
                    method = getattr(self.inner, name)
                    return lambda *args, **kwargs: kept(self.number, name, lambda: method(*args, **kwargs))
                return kept(self.number, name, lambda: getattr(self.inner, name))

        def kept(number: int, name: str, answer: Callable):
            try:
                got = answer()
            except Exception as exc:
                log.append([number, name, {"raised": type(exc).__name__, "message": str(exc)[:500]}])
                raise
            log.append([number, name, _as_data(got, enums)])
            return got
        Recorded.__name__ = getattr(cls, "__name__", "Recorded")
        return Recorded

    def replay(answers: Answers) -> type:
        numbers_given = itertools.count()

        class Replayed:
            def __init__(self, *args, **kwargs):
                self.number = next(numbers_given)

            def __getattr__(self, name: str):
                if name not in members:
                    raise AttributeError(name)
                if name in methods:
                    return lambda *args, **kwargs: given(self.number, name)
                return given(self.number, name)

        def given(number: int, name: str):
            entry = answers.take()
            if not (isinstance(entry, list) and entry[:2] == [number, name] and len(entry) == 3):
                raise CheckFailed(f"the sandbox's answers part from the grader's questions at answer {answers.next}: "
                                  f"it asked instance {number} for {name}; the reply does not come from this check")
            answer = entry[2]
            if isinstance(answer, dict) and "raised" in answer:
                raise _error(str(answer["raised"]), by_name)(str(answer.get("message", "")))
            if isinstance(answer, dict) and "enum" in answer:
                member = getattr(by_name.get(str(answer["enum"])), str(answer.get("name")), None)
                return member if isinstance(member, enum.Enum) else StandIn(f"{answer['enum']}.{answer.get('name')}")
            if isinstance(answer, dict):
                return StandIn(str(answer.get("stand_in")), bool(answer.get("truthy")))
            return answer
        return Replayed
    return Decisions(record, replay)


def _as_data(got: Any, enums: tuple[type, ...]) -> Any:
    """An answer as JSON data: a known enum by name, plain values as they are, other integers and reals (numpy's) by
    their value, anything else as its text."""
    if type(got) in enums:
        return {"enum": type(got).__name__, "name": got.name}
    if got is None or type(got) in (str, int, float, bool):
        return got
    if isinstance(got, numbers.Integral) and not isinstance(got, bool):
        return operator.index(got)
    if isinstance(got, numbers.Real):
        return float(got)
    return {"stand_in": repr(got)[:500], "truthy": bool(got)}


def _error(name: str, known: dict[str, type]) -> type:
    """The class to raise for an error the learner's piece raised in the sandbox, by its name."""
    cls = known.get(name) or getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls
    return type(name if name.isidentifier() else "LearnersError", (Exception,), {})
