"""``kvlib grade``: a lab notebook's score, decided where the notebook cannot reach.

The lab and its tasks come from the grader (the ``labNN`` in the file name, or ``--lab``), never
from the notebook's metadata. No cell of the notebook runs: each task's definitions are extracted
from the saved file (``extract.py``) and run in a sandbox process (``sandbox.py``) on a copy of
kvlib without that task's answer. For every check the sandbox hands back an observation, or, for
tasks that declare ``Decisions``, what the learner's piece decided, which this process measures by
replaying it in the scenario itself; this process runs the same scenario on kvlib's own piece, with
the same fresh seed, and decides. A
folder of submissions is graded in parallel into a gradebook written only once every sandbox is
gone; one broken or hostile submission costs its own checks, within its own time budget.
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import nbformat

from kvlib.course.grading.bounds import unbounded
from kvlib.course.grading.checks import Check, Observed, Task, observe, verdict
from kvlib.course.grading.decisions import DECIDED, decided, measured
from kvlib.course.grading.extract import Statement, extract, load
from kvlib.course.grading.fingerprint import FLAG_AT, resemblance, shingles
from kvlib.course.grading.hidden import hidden_source, hiding
from kvlib.course.grading.report import GradeReport
from kvlib.course.grading.results import FAIL, NOT_GRADED, TIMED_OUT, CheckResult, TaskResult
from kvlib.course.grading.sandbox import (
    NOT_BOUNDED,
    NOT_ISOLATED,
    ROOT_OUTSIDE,
    Crashed,
    Limits,
    Sandbox,
    isolation,
    root_outside,
)

LAB_NAME = re.compile(r"lab\d\d")


def lab_of(path: str | Path) -> str:
    """``labNN`` from a notebook's file name; the grader knows each lab's tasks by that name alone."""
    match = LAB_NAME.search(Path(path).name)
    if match is None or importlib.util.find_spec(f"kvlib.course.grading.{match.group()}") is None:
        raise ValueError(f"cannot tell which lab {Path(path).name} is: its name should start with the lab's, e.g. "
                         f"lab02_allocator.ipynb, or pass --lab lab02")
    return match.group()


def tasks_of(lab: str) -> list[Task]:
    return importlib.import_module(f"kvlib.course.grading.{lab}").TASKS


def code_cells(path) -> list[str]:
    """The notebook's code cells as saved. Read here, in the grader: every sandbox imports ``extract.py``, and
    nbformat (with jsonschema) would add 1.4 s to each one's start."""
    nb = nbformat.read(str(path), as_version=4)
    return [cell.source for cell in nb.cells if cell.cell_type == "code"]


def grade_notebook(path: str | Path, lab: Optional[str] = None, limits: Limits = Limits(),
                   seed: Optional[int] = None) -> GradeReport:
    path = Path(path)
    lab = lab or lab_of(path)
    graded = grade_cells(lab, code_cells(path), limits, seed=seed)
    saved = datetime.datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y-%m-%d %H:%M:%S")
    notes = [f"graded {path.name} as saved at {saved}: edits not saved to the file are not graded", *graded.notes]
    return GradeReport(path, lab, graded.tasks, notes, graded.flags)


@dataclass
class Graded:
    tasks: list[TaskResult]
    notes: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)  # resemblances to kvlib's own answer, for the instructor


def grade_cells(lab: str, cells: list[str], limits: Limits = Limits(), runner: type = Sandbox,
                seed: Optional[int] = None) -> Graded:
    """Every task of ``lab`` on the learner's code cells: observed by ``runner``, decided here."""
    seed = secrets.randbelow(2**31) if seed is None else seed
    deadline = time.monotonic() + limits.budget_s
    tasks = tasks_of(lab)
    results: dict[str, TaskResult] = {}
    groups: dict[tuple, list[tuple[Task, list[Statement]]]] = {}  # tasks that hide the same answer share a sandbox
    rule_flags: list[str] = []
    for task in tasks:
        extracted = extract(cells, task.needs)
        if extracted.problems:
            results[task.name] = task.zero(NOT_GRADED, "; ".join(extracted.problems))
            continue
        if broken := task.breaches(extracted.statements):
            results[task.name] = task.zero(FAIL, f"the rule of the task is broken: {'; '.join(broken[:3])}")
            rule_flags.append(f"{task.name}: scored 0, its rule is broken: {'; '.join(broken)}")
            continue
        groups.setdefault(task.hidden, []).append((task, extracted.statements))
    flags = rule_flags
    to_grade = [task for graded in groups.values() for task, _ in graded]
    for hidden, graded in groups.items():
        statements = _union(s for _, kept in graded for s in kept)
        flags += _resemblances([task.name for task, _ in graded], hidden, statements)
        with runner(lab, statements, hidden, limits) as sandbox:
            for task, _ in graded:
                share = _share_of(task, to_grade[to_grade.index(task):], deadline)
                results[task.name] = _grade_task(sandbox, lab, task, seed, limits, share)
    notes = [NOT_ISOLATED.format(why=isolation())] if runner is Sandbox and isolation() else []
    notes += [NOT_BOUNDED.format(why=unbounded())] if runner is Sandbox and unbounded() else []
    notes += [ROOT_OUTSIDE.format(why=root_outside())] if runner is Sandbox and root_outside() else []
    return Graded([results[t.name] for t in tasks], notes, flags)


@dataclass(frozen=True)
class _Share:
    """What one task may use of the submission's time budget: ``seconds`` (until ``until``) of the time left
    (until ``budget_ends``)."""
    seconds: float
    until: float
    budget_ends: float


def _share_of(task: Task, tasks_left: list[Task], deadline: float) -> _Share:
    """``task``'s share of the time left, in proportion to its checks' limits against those of the tasks left (it
    first)."""
    weight = {t.name: sum(check.limit_s for check in t.checks) for t in tasks_left}
    now = time.monotonic()
    seconds = max(0.0, deadline - now) * weight[task.name] / sum(weight.values())
    return _Share(seconds, now + seconds, deadline)


def _grade_task(sandbox, lab: str, task: Task, seed: int, limits: Limits, share: _Share) -> TaskResult:
    """Each check may run for its own time limit, at most the task's share, within the budget left; once one has run
    out of time (a hang), the task's later checks have what is left of its share. So a task that hangs leaves the
    later tasks theirs, and honest slow checks may use the budget that quick tasks leave."""
    results: list[CheckResult] = []
    for check in task.checks:
        hung = any(result.status == TIMED_OUT for result in results)
        now = time.monotonic()
        left = min(share.budget_ends - now, share.until - now if hung else share.seconds)
        if left <= 0:
            why = (f"this task's share ({share.seconds:.3g} s) of the submission's time budget ({limits.budget_s:g} s) "
                   f"ran out before this check: an earlier check of the task ran out of time" if hung
                   else f"the submission's time budget ({limits.budget_s:g} s) ran out before this check")
            results.append(CheckResult(check.name, check.points, TIMED_OUT, why))
        else:
            results.append(_grade_check(sandbox, lab, task, check, seed, min(check.limit_s * limits.check_scale, left)))
    return TaskResult(task.name, results)


def _grade_check(sandbox, lab: str, task: Task, check: Check, seed: int, limit_s: float) -> CheckResult:
    reference = reference_observation(lab, task.name, check.name, seed)
    try:
        yours = sandbox.observe(task.name, check.name, seed, limit_s)
    except Crashed as exc:
        return CheckResult(check.name, check.points, exc.status, str(exc))
    return verdict(check, measured_once(lab, task, check, yours, seed), reference)


_COMPUTED: dict[tuple, Observed] = {}  # what the grader computed in a class run, by what it depends on
_COMPUTING = threading.Lock()


def _once(key: tuple, compute) -> Observed:
    """``compute()``, once per ``key`` in this process: one computation at a time, each result kept."""
    with _COMPUTING:
        if key not in _COMPUTED:
            _COMPUTED[key] = compute()
        return _COMPUTED[key]


def reference_observation(lab: str, task_name: str, check_name: str, seed: int) -> Observed:
    """What kvlib's own piece shows in a check, computed in this process (once per seed)."""
    task = next(t for t in tasks_of(lab) if t.name == task_name)
    return _once(("reference", lab, task_name, check_name, seed),
                 lambda: observe(task.named(check_name), task.reference(), seed))


def measured_once(lab: str, task: Task, check: Check, seen: Observed, seed: int) -> Observed:
    """``measured``, once per list of decisions in a class run: the submissions that decide alike (every
    correct one, often) share the grader's replay of them."""
    if seen.status != DECIDED:
        return measured(task, check, seen, seed)
    return _once(("measured", lab, task.name, check.name, seed, json.dumps(seen.observation)),
                 lambda: measured(task, check, seen, seed))


def _union(statements) -> list[Statement]:
    unique = {(s.cell, s.first_line): s for s in statements}
    return [unique[k] for k in sorted(unique)]


def _resemblances(task_names: list[str], hidden: tuple[str, ...], statements: list[Statement]) -> list[str]:
    mine = shingles("\n".join(s.source for s in statements))
    flags = []
    for entry, source in hidden_source(hidden).items():
        share = resemblance(mine, source)
        if share >= FLAG_AT:
            module, qualname = entry.split(":")
            flags.append(f"{', '.join(task_names)}: the code repeats {share:.0%} of kvlib's own {qualname} "
                         f"({module}): look before accepting it")
    return flags


class InProcess:
    """The sandbox's interface in this process, for trusted code only: the tests of the graders themselves.
    kvlib's answers are hidden while the learner's code runs, as in the sandbox's copy of kvlib."""

    def __init__(self, lab: str, statements: list[Statement], hidden: tuple[str, ...], limits: Limits = Limits()):
        self.tasks = {task.name: task for task in tasks_of(lab)}
        self.startup_error: Optional[str] = None
        try:
            with hiding(hidden):  # what the learner's code takes from kvlib at load time is the stub, too
                self.namespace = load(statements).__dict__  # trusted test code
        except Exception as exc:  # noqa: BLE001 - the same report the sandbox gives
            self.startup_error = f"your definitions raise {type(exc).__name__}: {exc} when they run"

    def __enter__(self) -> "InProcess":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def observe(self, task: str, check: str, seed: int, limit_s: float) -> Observed:
        if self.startup_error is not None:
            raise Crashed(self.startup_error)
        graded = self.tasks[task]
        with hiding(graded.hidden):
            return decided(graded, graded.named(check), graded.piece(self.namespace), seed)


def grade_folder(folder: str | Path, lab: Optional[str] = None, jobs: int = 2,
                 limits: Limits = Limits(), seed: Optional[int] = None) -> list[GradeReport]:
    """Every ``*.ipynb`` in ``folder``, ``jobs`` at a time, in submission-name order, all on one fresh seed
    (so kvlib's own observations are computed once for the class)."""
    paths = sorted(Path(folder).glob("*.ipynb"))
    seed = secrets.randbelow(2**31) if seed is None else seed
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda p: _grade_one(p, lab, limits, seed), paths))


def _grade_one(path: Path, lab: Optional[str], limits: Limits, seed: int) -> GradeReport:
    """One submission's report, whatever is wrong with it: an unreadable one scores zero on every task
    of its lab, so its gradebook row has the same columns and maximum as the others."""
    try:
        lab = lab or lab_of(path)
    except ValueError as exc:
        return GradeReport(path, "?", [], [str(exc)])
    try:
        return grade_notebook(path, lab, limits, seed)
    except Exception as exc:  # noqa: BLE001 - an unreadable submission is reported, the others still grade
        why = f"{type(exc).__name__}: {exc}"
        return GradeReport(path, lab, [task.zero(NOT_GRADED, why) for task in tasks_of(lab)],
                           [f"could not be graded: {why}"])


def grade_here(path: str | Path | None = None) -> None:
    """From inside a lab notebook: grade the notebook you have open (or ``path``), as ``kvlib grade`` would.

    In Colab the open notebook is fetched from the browser; in Jupyter it is the file on disk, so
    unsaved edits are not graded, and a warning says so when cells ran after the last save.
    """
    path = Path(path) if path is not None else _open_notebook()
    last_run = float(os.environ.get("KVLIB_LAST_CELL_RUN", "0"))
    if path.stat().st_mtime + 1 < last_run:
        print(f"warning: {path.name} on disk is older than the cells you ran since: save it (Ctrl+S) first, "
              f"or your latest code is not graded")
    result = subprocess.run([sys.executable, "-m", "kvlib.cli", "grade", str(path)], capture_output=True, text=True)
    print(result.stdout or result.stderr)


def _open_notebook() -> Path:
    if "google.colab" in sys.modules:
        import json
        import tempfile

        from google.colab import _message  # noqa: PLC0415 - exists only in Colab
        notebook = _message.blocking_request("get_ipynb", timeout_sec=60)["ipynb"]
        name = os.environ.get("KVLIB_LAB_FILE", "lab.ipynb")
        path = Path(tempfile.mkdtemp()) / name
        path.write_text(json.dumps(notebook))
        return path
    session = os.environ.get("JPY_SESSION_NAME")
    if session and Path(session).is_file():
        return Path(session)
    raise RuntimeError("cannot find this notebook's file (it is not open in Jupyter or Colab): pass it, "
                       "grade_here('labs/lab02_allocator.ipynb'), or run `kvlib grade labs/labNN_topic.ipynb` "
                       "in a terminal")


def mark_cell_run() -> None:
    """Registered by the notebooks' first cell: when a cell last ran, to compare with the file's save time."""
    os.environ["KVLIB_LAST_CELL_RUN"] = str(time.time())

