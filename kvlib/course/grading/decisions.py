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
import contextlib
import dataclasses
import enum
import itertools
import numbers
import operator
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any, Callable, ContextManager, Optional

from kvlib.course.grading.checks import CheckFailed, Observed, observe
from kvlib.course.grading.results import FAIL

DECIDED = "decided"  # a sandbox's reply that carries decisions, to be measured by the grader


@dataclass(frozen=True)
class Decisions:
    """How a task's piece is recorded in the sandbox and replayed in the grader.

    ``record(piece, log)`` wraps the learner's piece so that every answer it gives is appended to
    ``log`` as JSON data; ``replay(log)`` is the grader's own piece answering the same calls, in the
    same order, with those answers (:class:`Answers` hands them out). ``recording()`` is entered while
    the recorded piece runs (to record what reaches kvlib's own classes by ``super()``).
    """

    record: Callable[[Any, list], Any]
    replay: Callable[["Answers"], Any]
    recording: Callable[[], ContextManager] = contextlib.nullcontext


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
    with task.decisions.recording():
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
                raise error_named(str(answer["raised"]), by_name)(str(answer.get("message", "")))
            if isinstance(answer, dict) and "enum" in answer:
                member = getattr(by_name.get(str(answer["enum"])), str(answer.get("name")), None)
                return member if isinstance(member, enum.Enum) else StandIn(f"{answer['enum']}.{answer.get('name')}")
            if isinstance(answer, dict):
                return StandIn(str(answer.get("stand_in")), bool(answer.get("truthy")))
            return answer
        return Replayed
    return Decisions(record, replay)


def acts_on(protocol: type, acts: tuple[str, ...], errors: tuple[type, ...] = (), kinds: tuple[type, ...] = ()
            ) -> Decisions:
    """A class of ``protocol`` whose members act on what they are given (lab 05's sharing: an allocator, a block
    table, a ``take_block``; lab 10's tier: the host pool's allocator, given to its constructor). Each call, the
    constructor's included, is recorded with what it did, in order (every call of one of ``acts`` on an argument,
    and every call of a function argument, each with its answer or error), what every list argument holds when it
    returns, and its own answer or error; an answer of one of ``kinds`` (dataclasses) is kept field by field, what
    ``__iter__`` yields item by item. The grader's class does the same to the grader's arguments, so the pools, the
    tables and the engine it measures are its own; an act that answers there otherwise than it did in the sandbox
    means the reply is not this check's. An argument kept for later records into the call running then."""
    from kvlib.interfaces import protocol_members
    members = protocol_members(protocol)
    properties = {name for name in members if isinstance(getattr(protocol, name, None), property)}
    kinds_by_name = {cls.__name__: cls for cls in kinds}
    errors_by_name = {cls.__name__: cls for cls in (CheckFailed, *errors)}  # a check of the scenario's that failed

    def record(cls, log: list) -> type:
        numbers_given = itertools.count()

        def recorded(instance, name: str, args: tuple, act: Callable) -> Any:
            effects: list = []
            entry = [instance.number, name, effects]
            log.append(entry)
            instance.calls.append(effects)  # what the arguments, this call's or kept ones, do now is this call's
            given = [_acting(arg, index, acts, instance.running, kinds) for index, arg in enumerate(args)]
            try:
                got = act(*given)
                if name == "__iter__" and isinstance(got, Iterator):  # recorded item by item, handed on as one
                    items = list(got)
                    got, outcome = iter(items), {"iterator": [encoded(item, kinds) for item in items]}
                else:
                    outcome = _returned(got, args, kinds)
            except Exception as exc:
                entry += [_lists(args, kinds), {"raised": type(exc).__name__, "message": str(exc)[:500]}]
                raise
            finally:
                instance.calls.pop()
            entry += [_lists(args, kinds), outcome]
            return got

        def __init__(self, *args):
            self.number, self.calls = next(numbers_given), []
            outer = [_acting(arg, -1 - index, acts, self.running, kinds) for index, arg in enumerate(args)]
            self.inner = recorded(self, "__init__", args, lambda *_: cls(*outer))

        def running(self) -> list:
            """The effects of the call running now (none: an act outside every call is not the piece's)."""
            return self.calls[-1] if self.calls else []

        def member(name: str):
            if name in properties:
                return property(lambda self: recorded(self, name, (), lambda: getattr(self.inner, name)))
            return lambda self, *args: recorded(self, name, args, getattr(self.inner, name))
        body = {"__init__": __init__, "running": running, **{name: member(name) for name in members}}
        return type(getattr(cls, "__name__", "Recorded"), (), body)

    def replay(answers: Answers) -> type:
        numbers_given = itertools.count()

        def replayed(number: int, name: str, args: tuple, outer: tuple) -> Any:
            entry = answers.take()
            if not (isinstance(entry, list) and entry[:2] == [number, name] and len(entry) == 5):
                raise CheckFailed(f"the sandbox's record parts from the grader's calls at call {answers.next}: it "
                                  f"called instance {number}'s {name}; the reply does not come from this check")
            for effect in entry[2] if isinstance(entry[2], list) else [None]:
                _act_again(effect, args, outer, acts, kinds_by_name)
            for index, items in entry[3] if isinstance(entry[3], list) else ():
                if isinstance(index, int) and 0 <= index < len(args) and isinstance(args[index], list):
                    args[index][:] = [decoded(item, kinds_by_name) for item in items]
            outcome = entry[4]
            if isinstance(outcome, dict) and "raised" in outcome:
                raise error_named(str(outcome["raised"]), errors_by_name)(str(outcome.get("message", "")))
            if isinstance(outcome, dict) and "argument" in outcome:
                return args[outcome["argument"]] if outcome["argument"] in range(len(args)) else None
            got = decoded(outcome, kinds_by_name)
            return iter(got) if isinstance(outcome, dict) and "iterator" in outcome else got

        def __init__(self, *args):
            self.number, self.outer = next(numbers_given), args
            replayed(self.number, "__init__", args, args)

        def member(name: str):
            if name in properties:
                return property(lambda self: replayed(self.number, name, (), self.outer))
            return lambda self, *args: replayed(self.number, name, args, self.outer)
        return type("Replayed", (), {"__init__": __init__, **{name: member(name) for name in members}})
    return Decisions(record, replay)


class _Acting:
    """An argument whose ``acts`` are recorded, as [argument, act, args, keywords, answer], in the effects of the
    call ``effects()`` names: the call running now. It passes for the object it wraps (``isinstance``)."""

    def __init__(self, inner, index: int, acts: tuple[str, ...], effects: Callable[[], list], kinds: tuple):
        self._inner, self._index, self._acts, self._effects, self._kinds = inner, index, acts, effects, kinds

    @property
    def __class__(self):
        return type(self._inner)

    def __getattr__(self, name: str):
        attribute = getattr(self._inner, name)
        if name not in self._acts:
            return attribute
        return lambda *args, **kwargs: _kept(self._effects(), self._index, name, args, kwargs, attribute, self._kinds)


def _acting(arg: Any, index: int, acts: tuple[str, ...], effects: Callable[[], list], kinds: tuple) -> Any:
    """What the learner's code is handed for ``arg``: data as it is (a list's contents are read after the call),
    functions and objects with any of ``acts`` wrapped so that what the code does with them is recorded."""
    if arg is None or isinstance(arg, (list, tuple, int, str, float)):
        return arg
    if any(hasattr(arg, act) for act in acts):
        return _Acting(arg, index, acts, effects, kinds)
    if callable(arg):
        return lambda *args, **kwargs: _kept(effects(), index, None, args, kwargs, arg, kinds)
    return arg


def _kept(effects: list, index: int, act: Optional[str], args: tuple, kwargs: dict, run: Callable, kinds: tuple):
    effect = [index, act, [encoded(a, kinds) for a in args], {k: encoded(v, kinds) for k, v in kwargs.items()}]
    try:
        got = run(*args, **kwargs)
    except Exception as exc:
        effects.append(effect + [{"raised": type(exc).__name__}])
        raise
    effects.append(effect + [encoded(got, kinds)])
    return got


def _act_again(effect: Any, args: tuple, outer: tuple, acts: tuple[str, ...], kinds: dict) -> None:
    """Do in the grader what the learner's code did in the sandbox; it must answer as it answered there.
    An argument's index counts a call's arguments from 0 and the constructor's from -1 down."""
    given = list(outer)[::-1] + list(args)  # -1 - i: the constructor's argument i; i: the call's
    shaped = isinstance(effect, list) and len(effect) == 5 and isinstance(effect[0], int) and \
        -len(outer) <= effect[0] < len(args) and (effect[1] is None or effect[1] in acts) and \
        isinstance(effect[2], list) and isinstance(effect[3], dict)
    if not shaped:
        raise CheckFailed(f"the sandbox recorded {str(effect)[:200]} as something your code did; the reply does "
                          f"not come from this check")
    index, act, act_args, act_kwargs, answer = effect
    target = given[index + len(outer)]
    redo(act or "a function argument", answer, lambda: encoded((target if act is None else getattr(target, act))(
        *[decoded(a, kinds) for a in act_args], **{k: decoded(v, kinds) for k, v in act_kwargs.items()}),
        tuple(kinds.values())))


def redo(act: str, answer: Any, run: Callable[[], Any]) -> None:
    """Do in the grader what the learner's code did in the sandbox (``run`` returns its answer as data, or raises);
    it must answer as it answered there. A check of the scenario's own that fails on the way fails as itself."""
    try:
        got = run()
    except CheckFailed:
        raise
    except Exception as exc:
        got = {"raised": type(exc).__name__}
    if got != answer:
        raise CheckFailed(f"the sandbox's record parts from the grader's run: {act} answered {str(answer)[:100]} "
                          f"there and {str(got)[:100]} here: act only through what your code is given, and the "
                          f"same way each time, so the grader can do it again")


def _lists(args: tuple, kinds: tuple) -> list:
    return [[index, [encoded(item, kinds) for item in arg]] for index, arg in enumerate(args) if isinstance(arg, list)]


def _returned(got: Any, args: tuple, kinds: tuple) -> Any:
    """A member's answer as data: one of its own list arguments by position, anything else encoded (an iterator
    other than ``__iter__``'s as its text: the protocols ask for lists)."""
    same = next((index for index, arg in enumerate(args) if isinstance(arg, list) and got is arg), None)
    return {"argument": same} if same is not None else encoded(got, kinds)


class Fields:
    """A dataclass of a kind the check does not name, replayed by its fields: it reads, prints and compares alike."""

    def __init__(self, kind: str, fields: dict):
        self.__dict__.update(fields)
        self._kind = kind

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "_kind")
        return f"{self._kind}({shown})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Fields) and vars(self) == vars(other)

    __hash__ = None


def encoded(value: Any, kinds: tuple = ()) -> Any:
    """Plain values as they are; lists and tuples item by item; a dataclass field by field, by the first of
    ``kinds`` it is an instance of (a subclass's extra fields are its own business), else by its own class; enums
    by class and member name; integers and reals of other types (numpy's) by their value; anything else as its
    text and truth."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, enum.Enum):
        return {"enum": type(value).__name__, "name": value.name}
    if isinstance(value, (list, tuple)):
        return {"tuple" if isinstance(value, tuple) else "list": [encoded(v, kinds) for v in value]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = next((k for k in kinds if isinstance(value, k)), type(value))
        return {"kind": kind.__name__, "fields": {f.name: encoded(getattr(value, f.name), kinds)
                                                  for f in dataclasses.fields(kind)}}
    return _as_data(value, ())


def decoded(data: Any, kinds: dict) -> Any:
    """The value :func:`encoded` wrote; a dataclass of a kind the check does not name as :class:`Fields`, text as
    a stand-in."""
    if not isinstance(data, dict):
        return data
    if isinstance(data.get("list"), list) or isinstance(data.get("iterator"), list):
        return [decoded(v, kinds) for v in data.get("list", data.get("iterator"))]
    if isinstance(data.get("tuple"), list):
        return tuple(decoded(v, kinds) for v in data["tuple"])
    if "enum" in data:
        member = getattr(kinds.get(str(data["enum"])), str(data.get("name")), None)
        return member if isinstance(member, enum.Enum) else StandIn(f"{data['enum']}.{data.get('name')}")
    if isinstance(data.get("fields"), dict):
        fields = {str(k): decoded(v, kinds) for k, v in data["fields"].items()}
        kind = kinds.get(str(data.get("kind")))
        try:
            return kind(**fields) if kind is not None else Fields(str(data.get("kind")), fields)
        except TypeError:
            return Fields(str(data.get("kind")), fields)
    return StandIn(str(data.get("stand_in", data)), bool(data.get("truthy", True)))


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


def error_named(name: str, known: dict[str, type]) -> type:
    """The class to raise for an error the learner's piece raised in the sandbox, by its name."""
    cls = known.get(name) or getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls
    return type(name if name.isidentifier() else "LearnersError", (Exception,), {})
