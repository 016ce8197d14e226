"""Decisions of a subclass: the methods a learner overrides, recorded by what they did, and done again by the grader.

Lab 04's learner writes a ``Scheduler`` subclass's scheduling step and lab 06's a ``BlockManager`` subclass's
preemption mechanisms; both act through their base class's own actions (``start``, ``make_room``, ``move``;
``take``, ``release``, ``copy_out``, ...) and the objects it holds (a block manager, allocators) on sequences.
In the sandbox each call of an overridden method is recorded with the acts it did, in order (with their answers),
what it may reorder, fill or count as the call left it (the queues, a step's plan and moves), the sequences it
was given as the call left them, the pools' reference counts then, and its own answer. The grader's subclass
answers each call by doing the same to its own objects, so the scenario, the engine and the invariant checks it
measures run where the learner's code never was; a call that does or leaves something else there fails the check.
Sequences are named by when they were made, counted from the instance's own making (``new_seq_id``), so a record
names the grader's sequences as well as the sandbox's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import numbers
import operator
from dataclasses import dataclass
from typing import Any, Callable

from kvlib.core.block_manager import BlockManager
from kvlib.core.plan import Preemption, ScheduledChunk
from kvlib.core.preemption import LatestArrivalPolicy, VictimCandidate
from kvlib.core.prefix_cache import PrefixHit
from kvlib.core.scheduler import Scheduler
from kvlib.core.sequence import Sequence, SequenceStatus, new_seq_id
from kvlib.course.grading.checks import CheckFailed
from kvlib.course.grading.decisions import Answers, Decisions, decoded, encoded, error_named, redo


@dataclass(frozen=True)
class Overridable:
    """What a learner's subclass of ``base`` overrides (``methods``) and how those methods may act.

    ``actions``: the instance's own methods they call, each recorded and done again; ``held``: attributes holding
    objects whose methods they call, with those recorded (``{"bm": ("admit", ...)}``); ``given``: the same for
    their arguments, by position; ``kept``: dotted paths of what they may fill, reorder or count, from the instance
    or (a leading position) an argument, kept as each call left it (lists in place); ``pools``: paths of allocators
    whose reference counts must agree after each call; ``sequences``: every sequence the instance knows of;
    ``kinds``: the dataclasses and enums their answers and arguments may hold."""

    base: type
    methods: tuple[str, ...]
    actions: tuple[str, ...]
    held: dict
    kept: tuple[str, ...] = ()
    pools: tuple[str, ...] = ()
    sequences: Callable[[Any], list] = lambda instance: []
    kinds: tuple[type, ...] = ()
    given: dict = dataclasses.field(default_factory=dict)


# Lab 04: the scheduling step, acting through the scheduler's own actions and its block manager.
SCHEDULING_STEP = Overridable(
    Scheduler, ("schedule_running", "schedule_waiting"), ("make_room", "start", "move", "_preempt"),
    {"bm": ("swap_in", "admit", "grow", "swap_out", "drop")},
    ("running", "waiting", "swapped", "running_slots", "0.scheduled", "0.preemptions"),
    ("bm.device_pool", "bm.host_pool"), lambda scheduler: [*scheduler.running, *scheduler.waiting, *scheduler.swapped],
    (PrefixHit, VictimCandidate, ScheduledChunk, Preemption), {0: ("add",)})
# Lab 06: the preemption mechanisms, acting through the block manager's block actions and its allocators.
PREEMPTION_MECHANISMS = Overridable(
    BlockManager, ("swap_out", "swap_in", "drop", "host_blocks_needed"),
    ("take", "take_host", "share", "release", "release_host", "copy_out", "copy_in", "hold_host", "_let_go"),
    {pool: ("allocate", "fork", "free") for pool in ("device_pool", "host_pool")},
    ("moves.swap_out", "moves.swap_in", "moves.copies", "_held_host"), ("device_pool", "host_pool"))
# Lab 08: the swap-or-recompute choice, an answer the grader's engine asks for again.
COST_CHOICE = Overridable(LatestArrivalPolicy, ("choose_mode",), (), {})


def overrides_of(spec: Overridable) -> Decisions:
    """How a learner's subclass is recorded in the sandbox (``record``) and redone in the grader (``replay``)."""
    kinds = {cls.__name__: cls for cls in (SequenceStatus, *spec.kinds)}

    def record(cls, log: list) -> type:
        class Recorded(cls):
            def __init__(self, *args, **kwargs):
                self.first_seq_id, self.graded_calls = new_seq_id(), []
                super().__init__(*args, **kwargs)
                held = [proxy for name, proxy in vars(self).items() if name.startswith("held ")]
                for name, value in list(vars(self).items()):  # the same objects kept under other names
                    vars(self)[name] = next((proxy for proxy in held if value is proxy._inner), value)

        def held(name: str, acts: tuple[str, ...]) -> property:
            """Whatever the instance keeps under ``name``, and any alias of it, is the recording stand-in."""
            def keep(self, value) -> None:
                inner = value._inner if isinstance(value, _Held) else value
                self.__dict__[f"held {name}"] = _Held(inner, name, acts, self.graded_calls)
            def get(self):
                try:
                    return self.__dict__[f"held {name}"]
                except KeyError:
                    raise AttributeError(name) from None
            return property(get, keep)

        def overridden(name: str):
            def call(self, *args, **kwargs):
                if self.graded_calls:  # one graded method calling another: its acts are the outer call's
                    return getattr(cls, name)(self, *args, **kwargs)
                args_given = args + tuple(kwargs.values())
                current = _Call(args_given, self.first_seq_id, spec.kinds,
                                lambda: [_left(self, args_given, spec, current), _kept(self, spec.kept, current)])
                asked = _asked(args_given, self.first_seq_id)  # as it is given, before the call changes it
                args = tuple(_Held(arg, f"argument {i}", spec.given[i], self.graded_calls) if i in spec.given else arg
                             for i, arg in enumerate(args))
                entry = [name, current.effects]
                log.append(entry)
                self.graded_calls.append(current)
                try:
                    got = getattr(cls, name)(self, *args, **kwargs)
                except Exception as exc:
                    entry += [*current.state(), _counts(self, spec.pools),
                              {"raised": type(exc).__name__, "message": str(exc)[:500]}, asked]
                    raise
                finally:
                    self.graded_calls.pop()
                entry += [*current.state(), _counts(self, spec.pools), current.encoded(got), asked]
                return got
            return call

        def action(name: str):
            return _recorded_action(name, lambda self, *args, **kwargs: getattr(cls, name)(self, *args, **kwargs))
        for name, acts in spec.held.items():
            setattr(Recorded, name, held(name, acts))
        for name in spec.actions:
            setattr(Recorded, name, action(name))
        for name in spec.methods:
            setattr(Recorded, name, overridden(name))
        Recorded.__name__ = cls.__name__
        return Recorded

    @contextlib.contextmanager
    def recording():
        """kvlib's own actions record too while the scenario runs, for a learner's ``super().start(...)``."""
        originals = {name: vars(spec.base)[name] for name in spec.actions}
        try:
            for name, original in originals.items():
                setattr(spec.base, name, _recorded_action(name, original))
            yield
        finally:
            for name, original in originals.items():
                setattr(spec.base, name, original)

    def replay(answers: Answers) -> type:
        def redone(self, name: str, args: tuple, kwargs: dict) -> Any:
            args = args + tuple(kwargs.values())
            entry = answers.take()
            if not (isinstance(entry, list) and len(entry) == 7 and entry[0] == name and isinstance(entry[1], list)):
                raise CheckFailed(f"the sandbox's record parts from the grader's calls at call {answers.next}: the "
                                  f"grader called {name}; the reply does not come from this check")
            if entry[6] != _asked(args, self.first_seq_id):
                raise CheckFailed(f"the sandbox's record answers other questions: at call {answers.next} the grader "
                                  f"called {name} with other arguments; the reply does not come from this check")
            known = _Known(self, args, spec, kinds)
            for effect in entry[1]:
                _do_again(self, effect, known, spec)
            _leave(self, known, spec, entry[2], entry[3])
            if _counts(self, spec.pools) != entry[4]:
                raise CheckFailed(f"after {name}, the grader's pools hold other reference counts than the sandbox's "
                                  f"did: change blocks only through {', '.join(spec.actions)} or the objects "
                                  f"{spec.base.__name__} holds, so the grader can do the same")
            outcome = entry[5]
            if isinstance(outcome, dict) and "raised" in outcome:
                raise error_named(str(outcome["raised"]), {"CheckFailed": CheckFailed})(str(outcome.get("message", "")))
            return known.value(outcome)

        def __init__(self, *args, **kwargs):
            self.first_seq_id = new_seq_id()
            spec.base.__init__(self, *args, **kwargs)

        def member(name: str):
            return lambda self, *args, **kwargs: redone(self, name, args, kwargs)
        body = {"__init__": __init__, **{name: member(name) for name in spec.methods}}
        return type("Replayed", (spec.base,), body)
    return Decisions(record, replay, recording)


def _recorded_action(name: str, original: Callable) -> Callable:
    """``original``, recorded as an act of the graded call running now (not of an action running inside it)."""
    def act(self, *args, **kwargs):
        calls = vars(self).get("graded_calls")  # none: not recorded, or the constructor runs
        current = calls[-1] if calls else None
        if current is None or current.acting:
            return original(self, *args, **kwargs)
        return current.kept("self", name, args, kwargs, lambda: original(self, *args, **kwargs))
    return act


def _leave(instance, known: "_Known", spec: Overridable, sequences: Any, kept: Any) -> None:
    """Leave the sequences and what ``spec.kept`` names as the record says they were."""
    for named, state in sequences if isinstance(sequences, list) else ():
        seq = known.value(named)
        if not (isinstance(seq, Sequence) and isinstance(state, list) and len(state) == 5):
            raise CheckFailed("the sandbox's record of a sequence is not one")
        seq.host_blocks, seq.block_table.blocks, seq.num_computed_tokens, seq.block_hashes = (
            list(state[0]), list(state[1]), state[2], list(state[3]))
        seq.status = known.value(state[4])
    for path, value in zip(spec.kept, kept if isinstance(kept, list) else ()):
        _keep(instance, path, known.args, known.value(value))


def _key(seq: Sequence, first_seq_id: int) -> int:
    return seq.seq_id - first_seq_id


def _asked(value: Any, first_seq_id: int, depth: int = 0) -> Any:
    """What a graded call was asked, so that a record answers the grader's questions and no others: sequences by
    when they were made; whole numbers (numpy's too: an answer replayed as an int may feed the next call), names and
    flags as they are; lists and dataclasses item by item, two levels down; a float (a measured cost, a time) and
    any other object only by kind, since they may differ honestly."""
    if isinstance(value, _Held):
        value = value._inner
    if isinstance(value, Sequence):
        return {"sequence": _key(value, first_seq_id)}
    if isinstance(value, (bool, str, type(None))):
        return value
    if isinstance(value, numbers.Integral):
        return operator.index(value)
    if depth < 3 and isinstance(value, (list, tuple)):
        return [_asked(item, first_seq_id, depth + 1) for item in value]
    if depth < 3 and dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _asked(getattr(value, f.name), first_seq_id, depth + 1) for f in dataclasses.fields(value)}
        return {"kind": type(value).__name__, "fields": fields}
    return {"kind": type(value).__name__}


class _Call:
    """One graded call: what it did, as [target, act, args, keywords, the state before it, answer], and how it
    names what it was given. ``state()`` is the sequences and the kept values as they are now, so that code which
    changes some of them by hand between acts is replayed with them as they were at each act."""

    def __init__(self, args: tuple, first_seq_id: int, kinds: tuple, state: Callable[[], list] = list):
        self.args, self.first_seq_id, self.kinds, self.state = args, first_seq_id, kinds, state
        self.effects: list = []
        self.acting = False  # inside an action: what the action does is the action's, not the call's

    def kept(self, target: str, act: str, args: tuple, kwargs: dict, run: Callable) -> Any:
        effect = [target, act, [self.encoded(a) for a in args], {k: self.encoded(v) for k, v in kwargs.items()},
                  self.state()]
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
        """A sequence by when it was made, an object the call was given by its place, else as data."""
        if isinstance(value, Sequence):
            return {"sequence": _key(value, self.first_seq_id)}
        if isinstance(value, list):
            return {"list": [self.encoded(item) for item in value]}
        if type(value) in self.kinds and dataclasses.is_dataclass(value):  # field by field: they may hold sequences
            return {"kind": type(value).__name__, "fields": {f.name: self.encoded(getattr(value, f.name))
                                                             for f in dataclasses.fields(value)}}
        if isinstance(value, _Held):  # a recording stand-in is named as what it stands for
            value = value._inner
        place = next((i for i, arg in enumerate(self.args) if arg is value), None)
        if place is not None and not isinstance(value, (int, str, float, tuple, type(None))):
            return {"argument": place}
        return encoded(value, self.kinds)


class _Known:
    """In the grader: the objects a record may name, for one call."""

    def __init__(self, instance, args: tuple, spec: Overridable, kinds: dict):
        self.instance, self.args, self.spec, self.kinds = instance, args, spec, kinds

    def value(self, data: Any) -> Any:
        if isinstance(data, dict) and "sequence" in data:
            key, first = data["sequence"], self.instance.first_seq_id
            known = {_key(seq, first): seq for seq in [*_given(self.args), *self.spec.sequences(self.instance)]}
            seq = known.get(key) if isinstance(key, int) else None
            if seq is None:
                raise CheckFailed(f"the sandbox's record names a sequence {str(key)[:80]} the grader's run does not "
                                  f"have; the reply does not come from this check")
            return seq
        if isinstance(data, dict) and "argument" in data:
            place = data["argument"]
            if not (isinstance(place, int) and 0 <= place < len(self.args)):
                raise CheckFailed("the sandbox's record names an argument the call was not given")
            return self.args[place]
        if isinstance(data, dict) and isinstance(data.get("list"), list):
            return [self.value(item) for item in data["list"]]
        kind = self.kinds.get(str(data.get("kind"))) if isinstance(data, dict) else None
        if kind is not None and isinstance(data.get("fields"), dict):  # a dataclass that may hold sequences
            return kind(**{str(k): self.value(v) for k, v in data["fields"].items()})
        return decoded(data, self.kinds)


class _Held:
    """An object the instance holds, whose ``acts`` are recorded when the graded code itself calls them."""

    def __init__(self, inner, name: str, acts: tuple[str, ...], calls: list):
        self._inner, self._name, self._acts, self._calls = inner, name, acts, calls

    @property
    def __class__(self):  # it passes for the object it wraps
        return type(self._inner)

    def __getattr__(self, name: str):
        attribute = getattr(self._inner, name)
        if name not in self._acts:
            return attribute

        def act(*args, **kwargs):  # whose call it is, is asked when it runs: it may have been kept for later
            current = self._calls[-1] if self._calls else None
            if current is None or current.acting:
                return attribute(*args, **kwargs)
            return current.kept(self._name, name, args, kwargs, lambda: attribute(*args, **kwargs))
        return act


def _given(args: tuple) -> list:
    """The sequences among ``args``, and in list arguments."""
    return [item for arg in args for item in (arg if isinstance(arg, list) else [arg]) if isinstance(item, Sequence)]


def _left(instance, args: tuple, spec: Overridable, call: _Call) -> list:
    """Every sequence the call was given or the instance knows, as it left it."""
    seqs = {seq.seq_id: seq for seq in [*_given(args), *spec.sequences(instance)]}.values()
    return [[call.encoded(seq), [[encoded(b) for b in seq.host_blocks], [encoded(b) for b in seq.block_table.blocks],
                                 encoded(seq.num_computed_tokens), [encoded(h) for h in seq.block_hashes],
                                 encoded(seq.status)]] for seq in seqs]


def _at(obj, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _from(instance, path: str, args: tuple) -> tuple[Any, str]:
    """The object a kept path starts from (the instance, or the argument a leading position names), and the rest."""
    first, _, rest = path.partition(".")
    return (args[int(first)], rest) if first.isdigit() else (instance, path)


def _kept(instance, paths: tuple[str, ...], call: _Call) -> list:
    return [call.encoded(_at(*_from(instance, path, call.args))) for path in paths]


def _keep(instance, path: str, args: tuple, value: Any) -> None:
    """Leave what ``path`` names as the record says the call left it: a list in place, anything else set."""
    start, rest = _from(instance, path, args)
    parent, _, name = rest.rpartition(".")
    owner = _at(start, parent) if parent else start
    if isinstance(getattr(owner, name), list) and isinstance(value, list):
        getattr(owner, name)[:] = value
    else:
        setattr(owner, name, value)


def _counts(obj, pools: tuple[str, ...]) -> list:
    """Every block's reference count in each pool."""
    return [[pool.ref_count(block) for block in range(pool.num_blocks)] for pool in (_at(obj, p) for p in pools)]


def _do_again(instance, effect: Any, known: _Known, spec: Overridable) -> None:
    """Do in the grader what the graded call did in the sandbox; it must answer as it answered there."""
    acts = {"self": spec.actions, **spec.held, **{f"argument {i}": acts for i, acts in spec.given.items()}}
    shaped = isinstance(effect, list) and len(effect) == 6 and isinstance(effect[2], list) and \
        isinstance(effect[3], dict) and isinstance(effect[4], list) and len(effect[4]) == 2 and \
        isinstance(effect[0], str) and effect[1] in acts.get(effect[0], ())
    if not shaped:
        raise CheckFailed(f"the sandbox recorded {str(effect)[:200]} as something your method did; the reply does "
                          f"not come from this check")
    target, act, act_args, act_kwargs, before, answer = effect
    _leave(instance, known, spec, *before)  # as the code had left them by hand, if it had
    if target.startswith("argument "):
        owner = known.args[int(target.split()[1])]
    else:
        owner = instance if target == "self" else getattr(instance, target)
    method = getattr(owner, act)
    call = _Call(known.args, instance.first_seq_id, spec.kinds)
    redo(act, answer, lambda: call.encoded(method(*[known.value(a) for a in act_args],
                                                  **{k: known.value(v) for k, v in act_kwargs.items()})))
