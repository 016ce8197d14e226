"""Checks that run a learner's subclass of a kvlib class with the graded methods of the base refused.

Some labs hand the learner a seam: a subclass of ``Scheduler`` or ``BlockManager`` whose graded
methods the learner writes (``Rules.own_methods``). The extractor refuses ``super().method``;
:func:`own_work` also refuses the other ways to reach the base's own version: calling it through
the class (``Scheduler.schedule_running(self, ...)``) while the learner's code runs in a check,
and keeping it from before the check began (a class attribute, a default argument, a closure or a
module-level name holding it). Lab 08 uses it too, to refuse kvlib's own swap-or-recompute choice
while the learner's is graded.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

from kvlib.course.grading.checks import CheckFailed

REFUSAL = ("your code calls kvlib's own {cls}.{name}: a graded method must do its work itself, with the actions "
           "the lab lists")


@contextmanager
def own_work(base: type, names: tuple[str, ...], learner: Optional[type] = None,
             refusal: str = REFUSAL) -> Iterator[None]:
    """While the block runs, calling ``base.<name>`` for any of ``names`` fails the check with
    ``refusal`` (formatted with ``cls`` and ``name``); so does a ``learner`` class that keeps one of them."""
    saved = {name: base.__dict__[name] for name in names}
    if learner is not None:
        kept = _kept_originals(learner, {method: name for name, method in saved.items()})
        if kept:
            raise CheckFailed(f"your {learner.__name__} keeps kvlib's own {base.__name__}.{kept}: a graded method must "
                              f"do its work itself, with the actions the lab lists")

    def refused(name: str):
        def call(*args, **kwargs):
            raise CheckFailed(refusal.format(cls=base.__name__, name=name))
        return call

    for name in names:
        setattr(base, name, refused(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(base, name, method)


def _kept_originals(learner: type, originals: dict) -> Optional[str]:
    """The name of an original that the learner's own classes hold, or the functions they define reach."""
    for klass in learner.__mro__:
        if klass.__module__.startswith("kvlib") or klass is object:
            continue  # kvlib's own classes, and the grader's wrappers around the learner's
        for value in vars(klass).values():
            for function in _functions(value):
                if function in originals:
                    return originals[function]
                cells = [c.cell_contents for c in (function.__closure__ or ()) if _filled(c)]
                reached = [*(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).values(), *cells,
                           *(function.__globals__.get(n) for n in _names(function.__code__))]
                found = next((originals[v] for v in reached if _hashable(v) and v in originals), None)
                if found:
                    return found
    return None


def _names(code) -> set:
    """Global names a function's code reads, its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def _functions(value) -> list:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if f is not None]
    return [value] if hasattr(value, "__code__") else []


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
