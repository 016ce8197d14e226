"""Decisions of a subclass: the methods a learner overrides, recorded by what they did, and done again by the grader.

Lab 06's learner writes the preemption mechanisms of a ``BlockManager`` subclass; they act through the block
manager's own block actions (``take``, ``release``, ``copy_out``, ...) on the sequences they are given. In the
sandbox each call of an overridden method is recorded with the actions it took (with their answers), what the
allocators were asked directly, every sequence it was given as the call left it, the pools' reference counts
then, and its own answer. The grader's subclass answers each call by doing the same to its own block manager and
sequences, so the scenario, the engine and the invariant checks it measures run where the learner's code never
was; a call that does or leaves something else there than in the sandbox fails the check.
"""
from __future__ import annotations

from typing import Any, Callable

from kvlib.core.sequence import Sequence
from kvlib.course.grading.checks import CheckFailed
from kvlib.course.grading.decisions import Answers, Decisions, decoded, encoded, error_named


def overrides_of(base: type, methods: tuple[str, ...], actions: tuple[str, ...], pools: tuple[str, ...],
                 lists: tuple[str, ...] = ()) -> Decisions:
    """``methods`` of the learner's subclass of ``base``, which act through ``actions`` of the instance and the
    allocators named ``pools`` on the :class:`Sequence` objects among their arguments; the instance's ``lists``
    (dotted paths: a step's planned moves) are recorded as each call left them, and so left by the grader."""
    def record(cls, log: list) -> type:
        class Recorded(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.graded_calls: list[_Call] = []
                for name in pools:
                    setattr(self, name, _Pool(getattr(self, name), name, self.graded_calls))

        def overridden(name: str):
            def call(self, *args):
                if self.graded_calls:  # one graded method calling another: its acts are the outer call's
                    return getattr(cls, name)(self, *args)
                current = _Call(args)
                entry = [name, current.effects]
                log.append(entry)
                self.graded_calls.append(current)
                try:
                    got = getattr(cls, name)(self, *args)
                except Exception as exc:
                    entry += [_left(args), _lists(self, lists), _counts(self, pools),
                              {"raised": type(exc).__name__, "message": str(exc)[:500]}]
                    raise
                finally:
                    self.graded_calls.pop()
                entry += [_left(args), _lists(self, lists), _counts(self, pools), current.encoded(got)]
                return got
            return call

        def action(name: str):
            def act(self, *args):
                calls = getattr(self, "graded_calls", None)  # None while the constructor runs
                current = calls[-1] if calls else None
                if current is None or current.acting:
                    return getattr(cls, name)(self, *args)
                return current.kept("self", name, args, lambda: getattr(cls, name)(self, *args))
            return act
        for name in actions:
            setattr(Recorded, name, action(name))
        for name in methods:
            setattr(Recorded, name, overridden(name))
        Recorded.__name__ = cls.__name__
        return Recorded

    def replay(answers: Answers) -> type:
        def redone(self, name: str, args: tuple) -> Any:
            entry = answers.take()
            if not (isinstance(entry, list) and len(entry) == 6 and entry[0] == name and isinstance(entry[1], list)):
                raise CheckFailed(f"the sandbox's record parts from the grader's calls at call {answers.next}: the "
                                  f"grader called {name}; the reply does not come from this check")
            for effect in entry[1]:
                _do_again(self, effect, args, actions, pools)
            given = _sequences(args)
            for where, state in entry[2] if isinstance(entry[2], list) else ():
                seq = given.get(tuple(where) if isinstance(where, list) else None)
                if seq is None or not (isinstance(state, list) and len(state) == 4):
                    raise CheckFailed("the sandbox's record names a sequence your method was not given")
                seq.host_blocks, seq.block_table.blocks, seq.num_computed_tokens, seq.block_hashes = (
                    list(state[0]), list(state[1]), state[2], list(state[3]))
            for path, items in zip(lists, entry[3] if isinstance(entry[3], list) else ()):
                _at(self, path)[:] = [decoded(item, {}) for item in items]
            if _counts(self, pools) != entry[4]:
                raise CheckFailed(f"after {name}, the grader's pools hold other reference counts than the sandbox's "
                                  f"did: change blocks only through the block manager's actions ({', '.join(actions)})"
                                  f" or its allocators, so the grader can do the same")
            outcome = entry[5]
            if isinstance(outcome, dict) and "raised" in outcome:
                raise error_named(str(outcome["raised"]), {})(str(outcome.get("message", "")))
            return decoded(outcome, {})

        def member(name: str):
            return lambda self, *args: redone(self, name, args)
        return type("Replayed", (base,), {name: member(name) for name in methods})
    return Decisions(record, replay)


class _Call:
    """One graded call: the sequences it was given, and what it did, as [target, act, args, answer]."""

    def __init__(self, args: tuple):
        self.where = {id(seq): list(at) for at, seq in _sequences(args).items()}
        self.effects: list = []
        self.acting = False  # inside an action: what the action does is the action's, not the call's

    def kept(self, target: str, act: str, args: tuple, run: Callable) -> Any:
        effect = [target, act, [self.encoded(a) for a in args]]
        self.acting = True
        try:
            got = run()
        except Exception as exc:
            self.effects.append(effect + [{"raised": type(exc).__name__}])
            raise
        finally:
            self.acting = False
        self.effects.append(effect + [self.encoded(got)])
        return got

    def encoded(self, value: Any) -> Any:
        """A sequence the call was given by where it was given; anything else as data."""
        if isinstance(value, Sequence):
            return {"sequence": self.where.get(id(value))}
        return encoded(value)


class _Pool:
    """An allocator whose ``allocate``/``fork``/``free`` are recorded when the graded code itself calls them."""

    def __init__(self, inner, name: str, calls: list):
        self._inner, self._name, self._calls = inner, name, calls

    def __getattr__(self, name: str):
        attribute = getattr(self._inner, name)
        current = self._calls[-1] if self._calls else None
        if name not in ("allocate", "fork", "free") or current is None or current.acting:
            return attribute
        return lambda *args: current.kept(self._name, name, args, lambda: attribute(*args))


def _sequences(args: tuple) -> dict:
    """Each Sequence among ``args`` by where: (argument,) or (argument, item) for one in a list argument."""
    found = {}
    for i, arg in enumerate(args):
        if isinstance(arg, Sequence):
            found[(i,)] = arg
        elif isinstance(arg, list):
            found.update(((i, j), item) for j, item in enumerate(arg) if isinstance(item, Sequence))
    return found


def _left(args: tuple) -> list:
    """Every sequence the call was given, as it left it."""
    return [[list(at), [[encoded(b) for b in seq.host_blocks], [encoded(b) for b in seq.block_table.blocks],
                        encoded(seq.num_computed_tokens), [encoded(h) for h in seq.block_hashes]]]
            for at, seq in _sequences(args).items()]


def _at(obj, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _lists(obj, paths: tuple[str, ...]) -> list:
    return [[encoded(item) for item in _at(obj, path)] for path in paths]


def _counts(bm, pools: tuple[str, ...]) -> list:
    """Every block's reference count in each pool."""
    counted = []
    for name in pools:
        pool = getattr(bm, name)
        counted.append([pool.ref_count(block) for block in range(pool.num_blocks)])
    return counted


def _do_again(bm, effect: Any, args: tuple, actions: tuple[str, ...], pools: tuple[str, ...]) -> None:
    """Do in the grader what the graded call did in the sandbox; it must answer as it answered there."""
    if not (isinstance(effect, list) and len(effect) == 4 and isinstance(effect[2], list) and
            ((effect[0] == "self" and effect[1] in actions) or (effect[0] in pools and effect[1] in
                                                                ("allocate", "fork", "free")))):
        raise CheckFailed(f"the sandbox recorded {str(effect)[:200]} as something your method did; the reply does "
                          f"not come from this check")
    target, act, act_args, answer = effect
    given = _sequences(args)
    where = {id(seq): list(at) for at, seq in given.items()}

    def value(data: Any) -> Any:
        if isinstance(data, dict) and "sequence" in data:
            at = data["sequence"]
            seq = given.get(tuple(at) if isinstance(at, list) else None)
            if seq is None:
                raise CheckFailed("the sandbox's record names a sequence your method was not given")
            return seq
        return decoded(data, {})
    method = getattr(bm if target == "self" else getattr(bm, target), act)
    try:
        got = method(*[value(a) for a in act_args])
        got = {"sequence": where.get(id(got))} if isinstance(got, Sequence) else encoded(got)
    except CheckFailed:
        raise
    except Exception as exc:
        got = {"raised": type(exc).__name__}
    if got != answer:
        raise CheckFailed(f"the sandbox's record parts from the grader's run: {act} answered {str(answer)[:100]} "
                          f"there and {str(got)[:100]} here; the reply does not come from this check")
