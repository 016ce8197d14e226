"""No twin routes: no definition in kvlib that stays visible while a task is graded does the task's work.

A task hides kvlib's own answer (``Task.hidden``), but another definition, a course helper or an engine
function, may compute the same thing under another name: calling it would pass. This walks kvlib for
every definition with the task's interface (a function taking the same arguments, a class with the
same methods) and grades it, kvlib's answer hidden as in the sandbox, on the task's by-hand checks: none
may earn more than half their points. A helper reached through a wrapper of the learner's (another
signature) is not found here; lab 08's ``timing.compare`` is hidden by name for that reason.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import signal
import warnings
from dataclasses import replace

import pytest

import kvlib
from kvlib.course.grading.checks import FEEDBACK_SEED
from kvlib.course.grading.runner import tasks_of

LABS = ("lab02", "lab03", "lab04", "lab05", "lab06", "lab07", "lab08", "lab09", "lab10")
NOT_WALKED = ("kvlib.cli", "kvlib.serve", "kvlib.course.grading", "kvlib.__main__")  # commands, servers, the graders
SECONDS_PER_CANDIDATE = 20


class TookTooLong(BaseException):  # not an Exception: the checks' own handlers must not swallow it
    pass


def _modules():
    names = [m.name for m in pkgutil.walk_packages(kvlib.__path__, "kvlib.") if not m.name.startswith(NOT_WALKED)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            try:
                yield importlib.import_module(name)
            except ImportError:  # an optional extra that is not installed
                continue


def _definitions() -> list:
    seen, found = set(), []
    for module in _modules():
        for _, value in inspect.getmembers(module):
            if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__.startswith("kvlib") \
                    and id(value) not in seen:
                seen.add(id(value))
                found.append(value)
    return found


def _positional(function) -> tuple[int, int]:
    """How many positional arguments ``function`` needs, and takes at most."""
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return -1, -1
    if any(p.kind is p.KEYWORD_ONLY and p.default is p.empty for p in params):
        return -1, -1
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    most = 99 if any(p.kind is p.VAR_POSITIONAL for p in params) else len(positional)
    return sum(p.default is p.empty for p in positional), most


def _own_methods(cls) -> set[str]:
    return {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}


def _same_interface(candidate, reference) -> bool:
    if inspect.isclass(reference):
        wanted = _own_methods(reference)
        return inspect.isclass(candidate) and bool(wanted) and wanted <= {n for n in dir(candidate)
                                                                          if not n.startswith("_")}
    needed, most = _positional(reference)
    have, takes = _positional(candidate)
    return inspect.isfunction(candidate) and have <= needed <= takes and have >= 0


def _by_hand_tasks():
    """The first task of each graded name: the one that checks the piece by hand (later ones run engines)."""
    seen = set()
    for lab in LABS:
        for task in tasks_of(lab):
            if (lab, task.needs) not in seen:
                seen.add((lab, task.needs))
                yield pytest.param(task, id=f"{lab}-{task.name}")


@pytest.fixture(scope="module")
def definitions() -> list:
    return _definitions()


def twins_of(task, definitions: list) -> dict[str, int]:
    """Every definition with ``task``'s interface that earns more than half its by-hand points, kvlib's answer
    hidden; with the points each earned."""
    reference = task.reference()
    candidates = [d for d in definitions if _same_interface(d, reference)]  # kvlib's own answer too: hidden, it fails
    assert candidates or inspect.isfunction(reference), f"nothing in kvlib has {task.name}'s interface: walk broken?"

    def stop(*_):
        raise TookTooLong
    previous = signal.signal(signal.SIGALRM, stop)
    twins = {}
    try:
        for candidate in candidates:
            signal.alarm(SECONDS_PER_CANDIDATE)
            try:
                points = sum(c.points for c in task.verdicts(candidate, FEEDBACK_SEED))
            except TookTooLong:
                points = 0
            finally:
                signal.alarm(0)
            if points * 2 > sum(c.points for c in task.checks):
                twins[f"{candidate.__module__}:{candidate.__qualname__}"] = points
    finally:
        signal.signal(signal.SIGALRM, previous)
    return twins


@pytest.mark.parametrize("task", _by_hand_tasks())
def test_no_visible_definition_does_a_tasks_work(task, definitions, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a candidate that writes a file writes it here
    twins = twins_of(task, definitions)
    capsys.readouterr()
    assert twins == {}, f"visible while {task.name} is graded, and doing its work: hide them in its Task"


def test_the_walk_finds_an_answer_left_visible(definitions, capsys):
    from kvlib.course.grading import lab02, lab07
    assert set(twins_of(replace(lab02.allocator, hidden=()), definitions)) == {"kvlib.core.block_allocator:BlockAllocator"}
    assert set(twins_of(replace(lab07.select_victim, hidden=()), definitions)) == {"kvlib.core.preemption:SparingPolicy"}
    capsys.readouterr()
