"""Labs 04, 06 and 10 (a scheduler step, the preemption mechanisms, the host tier) grade as intended.

``tests/test_labs_graded.py`` grades their solutions, untouched labs and realistic bugs. Here: a
subclass seam cannot be turned into kvlib's own answer (``super()`` is refused when the notebook is
read, naming the base class when the check runs), forged cells change nothing, kvlib's own pieces
pass their own checks, and one notebook is graded end to end the way ``kvlib grade`` does.
"""
from __future__ import annotations

import types
from pathlib import Path

import pytest

from kvlib.block_manager import BlockManager
from kvlib.cli.bench.driver import ModelFreeEngine
from kvlib.cli.bench.workloads import Request
from kvlib.config import EngineConfig
from kvlib.course.grading import grade_notebook, lab04, lab06, lab10
from kvlib.course.grading.results import FAIL, NOT_ALLOWED, NOT_IMPLEMENTED, PASS
from kvlib.course.grading.runner import grade_cells
from kvlib.course.grading.sandbox import InProcess
from kvlib.prefix_cache import HostPrefixTier
from kvlib.scheduler import Scheduler
from test_labs_graded import cells_of

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = {lab: next((ROOT / "solutions").glob(f"{lab}_*.ipynb")) for lab in ("lab04", "lab06", "lab10")}
CLASS_LINE = "class MyScheduler(Scheduler):\n"  # lines of lab 04's solution that edits anchor on
RUNNING_LINE = "    def schedule_running(self, out: SchedulerOutput, budget: int) -> int:\n"
FIRST_SOLUTION_LINE = "        ### BEGIN SOLUTION\n        for seq in list(self.running):"


def _grade(lab: str, edits=(), extra=(), base: Path = None) -> dict:
    cells = cells_of(base or SOLUTIONS[lab], edits) + list(extra)
    return {t.task: t for t in grade_cells(lab, cells, runner=InProcess)}


def _statuses(task) -> set:
    return {c.status for c in task.checks}


# ---- delegating to kvlib's own implementation scores zero --------------------------------------
def test_a_scheduler_calling_kvlibs_step_by_name_scores_zero_for_that_method():
    graded = _grade("lab04", [(FIRST_SOLUTION_LINE,
                               "        return Scheduler.schedule_running(self, out, budget)\n" + FIRST_SOLUTION_LINE)])
    for task in ("schedule_running", "engine"):  # refused when the notebook is read, before anything runs
        assert graded[task].points == 0 and _statuses(graded[task]) == {NOT_ALLOWED}
        assert all("calls kvlib's own Scheduler.schedule_running" in c.message for c in graded[task].checks)
    assert graded["schedule_waiting"].full_marks  # its own method is still the learner's
    assert Scheduler.schedule_running is lab04.REFERENCE_RUNNING  # the refusal ends with the check


@pytest.mark.parametrize("keep, call", [
    ((CLASS_LINE, CLASS_LINE + "    theirs = Scheduler.schedule_running\n"), "self.theirs(out, budget)"),
    ((CLASS_LINE, "THEIRS = Scheduler.schedule_running\n\n\n" + CLASS_LINE), "THEIRS(self, out, budget)"),
    ((RUNNING_LINE, RUNNING_LINE.replace("budget: int)", "budget: int, theirs=Scheduler.schedule_running)")),
     "theirs(self, out, budget)"),
], ids=["class attribute", "module name", "default argument"])
def test_a_scheduler_keeping_kvlibs_step_from_before_the_check_scores_zero(keep, call):
    graded = _grade("lab04", [keep, (FIRST_SOLUTION_LINE, f"        return {call}\n" + FIRST_SOLUTION_LINE)])
    assert graded["schedule_running"].points == 0 and graded["engine"].points == 0
    assert all("kvlib's own Scheduler.schedule_running" in c.message for c in graded["schedule_running"].checks)


def test_a_scheduler_calling_super_is_refused_when_the_notebook_is_read():
    graded = _grade("lab04", [("        ### BEGIN SOLUTION\n        line = sorted(",
                               "        return super().schedule_waiting(out, budget)\n"
                               "        ### BEGIN SOLUTION\n        line = sorted(")])
    for task in ("schedule_waiting", "engine"):
        assert graded[task].points == 0 and _statuses(graded[task]) == {NOT_ALLOWED}
        assert "calls super().schedule_waiting" in graded[task].checks[0].message


def test_a_block_manager_delegating_drop_scores_zero_for_drop_and_the_engine():
    graded = _grade("lab06", [("        ### BEGIN SOLUTION\n        before = seq.num_computed_tokens",
                               "        return BlockManager.drop(self, seq, count)\n"
                               "        ### BEGIN SOLUTION\n        before = seq.num_computed_tokens")])
    assert graded["drop"].points == 0 and graded["engine"].points == 0
    assert graded["swap"].full_marks
    assert BlockManager.drop is lab06.REFERENCE_DROP


@pytest.mark.parametrize("edit", [
    ("class MyHostTier:", "from kvlib.prefix_cache import HostPrefixTier\n\n\nclass MyHostTier(HostPrefixTier):"),
    ("class MyHostTier:",
     "from kvlib import prefix_cache\nMyHostTier = prefix_cache.HostPrefixTier\n\n\nclass Unused:"),
])
def test_a_host_tier_taken_from_kvlib_scores_zero(edit):
    graded = _grade("lab10", [edit])
    assert all(t.points == 0 and _statuses(t) == {NOT_ALLOWED} for t in graded.values())


@pytest.mark.parametrize("lab, forged", [
    ("lab04", "from kvlib.course.grading import lab04\nlab04.expect = lambda *a, **k: None"),
    ("lab06", "import kvlib.course.grading.checks as c\nc.Task.run_check = lambda *a: None"),
    ("lab10", "MyHostTier = __import__('kvlib').prefix_cache.HostPrefixTier"),
])
def test_a_forged_cell_in_an_untouched_lab_changes_nothing(lab, forged):
    graded = _grade(lab, extra=[forged], base=ROOT / "labs" / SOLUTIONS[lab].name)
    assert sum(t.points for t in graded.values()) == 0
    assert {s for t in graded.values() for s in _statuses(t)} <= {NOT_IMPLEMENTED, NOT_ALLOWED}


# ---- kvlib's own pieces pass the checks written for the learner's ------------------------------
def _copied(base: type, names: tuple) -> type:
    """A subclass whose methods run copies of kvlib's code (kvlib's own functions would be refused)."""
    def copy(f):
        return types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return type("Own", (base,), {name: copy(base.__dict__[name]) for name in names})


def test_kvlibs_own_algorithms_get_full_marks():
    scheduler = _copied(Scheduler, lab04.GRADED)
    assert lab04.check_schedule_running(scheduler).full_marks and lab04.check_schedule_waiting(scheduler).full_marks
    block_manager = _copied(BlockManager, lab06.GRADED)
    assert lab06.check_swap(block_manager).full_marks and lab06.check_drop(block_manager).full_marks
    assert lab10.check_tier(HostPrefixTier).full_marks


def test_every_lab04_scenario_exercises_its_rule():
    plans = {name: lab04._reference_plans(name) for name in lab04.SCENARIOS}
    assert plans["chunked_prefill"][:2] == ({"a": 8, "b": 2}, {"a": 1, "b": 9})
    assert {"a": 33} in plans["watermark_waived"]  # a resumes alone, past the watermark
    assert {"b": 4, "c": 8} in plans["prefix_hits"]
    assert {"p": 6} in plans["max_num_seqs"]  # q waits while p's samples take their places


def test_the_model_free_driver_runs_a_learners_classes():
    seen = []

    class Counting(Scheduler):
        def schedule_waiting(self, out, budget):
            seen.append(len(self.waiting))
            return super().schedule_waiting(out, budget)

    e = ModelFreeEngine(EngineConfig(block_size=4, num_gpu_blocks=8, watermark=0.0), scheduler=Counting,
                        block_manager=type("Mine", (BlockManager,), {}))
    e.add("a", Request([1, 2, 3], 2))
    while e.has_unfinished():
        e.step()
    assert seen and type(e.block_manager).__name__ == "Mine"


# ---- a whole notebook, as `kvlib grade` runs it --------------------------------------------------
def test_the_lab10_solution_notebook_gets_full_marks_in_the_sandbox():
    report = grade_notebook(SOLUTIONS["lab10"])
    assert report.full_marks, report.table()
    assert {c.status for t in report.tasks for c in t.checks} == {PASS}
