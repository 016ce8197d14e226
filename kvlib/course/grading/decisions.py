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


def acts_on(methods: tuple[str, ...], acts: tuple[str, ...], errors: tuple[type, ...] = ()) -> Decisions:
    """A class whose ``methods`` act on what they are given (lab 05's sharing: an allocator, a block table, a
    ``take_block``): each call is recorded with what it did, in order (every call of one of ``acts`` on an
    argument, and every call of a function argument, each with its answer or error), what every list argument
    holds when it returns, and its own answer or error. The grader's class does the same to the grader's
    arguments, so the pool, the tables and the engine it measures are its own; an act that answers there
    otherwise than it did in the sandbox means the reply is not this check's."""
    def record(cls, log: list) -> type:
        numbers_given = itertools.count()

        def recorded(instance, name: str):
            def call(*args):
                effects: list = []
                entry = [instance.number, name, effects]
                log.append(entry)
                given = [_acting(arg, i, acts, effects) for i, arg in enumerate(args)]
                try:
                    got = getattr(instance.inner, name)(*given)
                except Exception as exc:
                    entry += [_lists(args), {"raised": type(exc).__name__, "message": str(exc)[:500]}]
                    raise
                entry += [_lists(args), _returned(got, args)]
                return got
            return call

        def __init__(self, *args, **kwargs):
            self.inner, self.number = cls(*args, **kwargs), next(numbers_given)
        members = {name: lambda self, *args, name=name: recorded(self, name)(*args) for name in methods}
        return type(getattr(cls, "__name__", "Recorded"), (), {"__init__": __init__, **members})

    def replay(answers: Answers) -> type:
        numbers_given = itertools.count()
        known = {cls.__name__: cls for cls in errors}

        def replayed(number: int, name: str, args: tuple):
            entry = answers.take()
            if not (isinstance(entry, list) and entry[:2] == [number, name] and len(entry) == 5):
                raise CheckFailed(f"the sandbox's record parts from the grader's calls at call {answers.next}: it "
                                  f"called instance {number}'s {name}; the reply does not come from this check")
            for effect in entry[2] if isinstance(entry[2], list) else [None]:
                _act_again(effect, args, acts)
            for index, items in entry[3] if isinstance(entry[3], list) else ():
                if isinstance(index, int) and 0 <= index < len(args) and isinstance(args[index], list):
                    args[index][:] = items
            outcome = entry[4]
            if isinstance(outcome, dict) and "raised" in outcome:
                raise _error(str(outcome["raised"]), known)(str(outcome.get("message", "")))
            return _given_back(outcome, args)

        def __init__(self, *args, **kwargs):
            self.number = next(numbers_given)
        members = {name: lambda self, *args, name=name: replayed(self.number, name, args) for name in methods}
        return type("Replayed", (), {"__init__": __init__, **members})
    return Decisions(record, replay)


class _Acting:
    """An argument whose ``acts`` are recorded in the current call's effects, as [argument, act, args, answer]."""

    def __init__(self, inner, index: int, acts: tuple[str, ...], effects: list):
        self._inner, self._index, self._acts, self._effects = inner, index, acts, effects

    def __getattr__(self, name: str):
        attribute = getattr(self._inner, name)
        if name not in self._acts:
            return attribute
        return lambda *args: _kept(self._effects, [self._index, name, [_as_data(a, ()) for a in args]],
                                   lambda: attribute(*args))


def _acting(arg: Any, index: int, acts: tuple[str, ...], effects: list) -> Any:
    """What the learner's method is handed for ``arg``: lists as they are (their contents are read after the call),
    functions and objects with any of ``acts`` wrapped so that what the method does with them is recorded."""
    if isinstance(arg, (list, int, str, float, type(None))):
        return arg
    if any(hasattr(arg, act) for act in acts):
        return _Acting(arg, index, acts, effects)
    if callable(arg):
        return lambda *args: _kept(effects, [index, None, [_as_data(a, ()) for a in args]], lambda: arg(*args))
    return arg


def _kept(effects: list, effect: list, act: Callable) -> Any:
    try:
        got = act()
    except Exception as exc:
        effects.append(effect + [{"raised": type(exc).__name__}])
        raise
    effects.append(effect + [_as_data(got, ())])
    return got


def _act_again(effect: Any, args: tuple, acts: tuple[str, ...]) -> None:
    """Do in the grader what the learner's method did in the sandbox; it must answer as it answered there."""
    shaped = isinstance(effect, list) and len(effect) == 4 and isinstance(effect[0], int) and \
        0 <= effect[0] < len(args) and (effect[1] is None or effect[1] in acts) and isinstance(effect[2], list)
    if not shaped:
        raise CheckFailed(f"the sandbox recorded {str(effect)[:200]} as something your method did; the reply does "
                          f"not come from this check")
    index, act, act_args, answer = effect
    target = args[index] if act is None else getattr(args[index], act)
    try:
        got = _as_data(target(*act_args), ())
    except Exception as exc:
        got = {"raised": type(exc).__name__}
    if got != answer:
        raise CheckFailed(f"the sandbox's record parts from the grader's run: {act or 'a function argument'} "
                          f"answered {str(answer)[:100]} there and {str(got)[:100]} here; the reply does not come "
                          f"from this check")


def _lists(args: tuple) -> list:
    return [[index, [_as_data(item, ()) for item in arg]] for index, arg in enumerate(args) if isinstance(arg, list)]


def _returned(got: Any, args: tuple) -> Any:
    """A method's answer as data: one of its own list arguments by position, a list or tuple item by item."""
    same = next((index for index, arg in enumerate(args) if isinstance(arg, list) and got is arg), None)
    if same is not None:
        return {"argument": same}
    if isinstance(got, (list, tuple)):
        return {type(got).__name__: [_as_data(item, ()) for item in got]}
    return _as_data(got, ())


def _given_back(outcome: Any, args: tuple) -> Any:
    if isinstance(outcome, dict) and isinstance(outcome.get("argument"), int) and 0 <= outcome["argument"] < len(args):
        return args[outcome["argument"]]
    if isinstance(outcome, dict) and isinstance(outcome.get("list"), list):
        return list(outcome["list"])
    if isinstance(outcome, dict) and isinstance(outcome.get("tuple"), list):
        return tuple(outcome["tuple"])
    if isinstance(outcome, dict):
        return StandIn(str(outcome.get("stand_in")), bool(outcome.get("truthy")))
    return outcome


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
