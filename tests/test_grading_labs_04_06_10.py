"""Labs 04, 06 and 10 (a scheduler step, the preemption mechanisms, the host tier) grade as intended.

``tests/test_labs_graded.py`` grades their solutions, untouched labs and realistic bugs. Here: kvlib's
own answer is hidden while a task runs (delegating to it, by name, through ``super()`` or by handing in
kvlib's class, is "not implemented"), exactly the graded methods are stubbed in the sandbox's copy of
kvlib, kvlib's own pieces pass their own checks, the scenarios exercise their rules on every seed, and
one notebook is graded end to end the way ``kvlib grade`` does.
"""
from __future__ import annotations

import ast
import random
import types
from pathlib import Path

import pytest
from notebook_cells import graded_cells

from kvlib.core.model_free import ModelFreeEngine
from kvlib.core.model_free import Request
from kvlib.config import EngineConfig
from kvlib.core.block_manager import BlockManager
from kvlib.core.prefix_cache import HostPrefixTier
from kvlib.core.scheduler import Scheduler
from kvlib.core.sequence import SequenceStatus
from kvlib.course.grading import grade_notebook, lab04, lab06, lab10
from kvlib.course.grading.hidden import module_file, stubbed_tree
from kvlib.course.grading.results import NOT_IMPLEMENTED, PASS
from kvlib.course.grading.runner import InProcess, grade_cells

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = {lab: next((ROOT / "solutions").glob(f"{lab}_*.ipynb")) for lab in ("lab04", "lab06", "lab10")}
FIRST_RUNNING_LINE = "        ### BEGIN SOLUTION\n        for seq in list(self.running):"
FIRST_WAITING_LINE = "        ### BEGIN SOLUTION\n        line = sorted("
FIRST_DROP_LINE = "        ### BEGIN SOLUTION\n        before = seq.num_computed_tokens"
ORIGINALS = (Scheduler.schedule_running, Scheduler.schedule_waiting, BlockManager.drop, HostPrefixTier.evict_one)


def _grade(lab: str, edits=(), extra=(), base: Path = None) -> dict:
    cells = graded_cells(base or SOLUTIONS[lab], edits) + list(extra)
    return {t.task: t for t in grade_cells(lab, cells, runner=InProcess, seed=1).tasks}


def _statuses(task) -> set:
    return {c.status for c in task.checks}


def _not_implemented(task, hidden: str) -> bool:
    return task.points == 0 and _statuses(task) == {NOT_IMPLEMENTED} and all(hidden in c.message for c in task.checks)


# ---- delegating to kvlib's own implementation scores zero --------------------------------------
@pytest.mark.parametrize("first, call, hidden, graded, kept", [
    (FIRST_RUNNING_LINE, "return Scheduler.schedule_running(self, out, budget)", "Scheduler.schedule_running",
     ("schedule_running", "engine"), "schedule_waiting"),
    (FIRST_WAITING_LINE, "return super().schedule_waiting(out, budget)", "Scheduler.schedule_waiting",
     ("schedule_waiting", "engine"), "schedule_running"),
], ids=["by name", "through super()"])
def test_a_scheduler_delegating_one_method_scores_zero_for_it_only(first, call, hidden, graded, kept):
    result = _grade("lab04", [(first, f"        {call}\n{first}")])
    assert all(_not_implemented(result[task], hidden) for task in graded)
    assert result[kept].full_marks  # kvlib's own other method runs beside it: only the graded one is hidden
    assert (Scheduler.schedule_running, Scheduler.schedule_waiting) == ORIGINALS[:2]  # hidden only while it runs


def test_a_block_manager_delegating_drop_scores_zero_for_drop_and_the_engine():
    result = _grade("lab06", [(FIRST_DROP_LINE, f"        return BlockManager.drop(self, seq, count)\n{FIRST_DROP_LINE}")])
    assert _not_implemented(result["drop"], "BlockManager.drop") and result["engine"].points == 0
    assert result["swap"].full_marks and BlockManager.drop is ORIGINALS[2]


@pytest.mark.parametrize("lab, cell", [
    ("lab04", "from kvlib.core.scheduler import Scheduler as MyScheduler"),
    ("lab06", "from kvlib.core.block_manager import BlockManager as MyBlockManager"),
    ("lab10", "from kvlib.core.prefix_cache import HostPrefixTier\n\n\nclass MyHostTier(HostPrefixTier):\n    pass"),
    ("lab10", "from kvlib.core import prefix_cache\nMyHostTier = prefix_cache.HostPrefixTier"),
])
def test_kvlibs_own_class_handed_in_scores_zero(lab, cell):
    result = _grade(lab, extra=[cell], base=ROOT / "labs" / SOLUTIONS[lab].name)
    assert sum(t.points for t in result.values()) == 0
    assert {s for t in result.values() for s in _statuses(t)} == {NOT_IMPLEMENTED}
    assert HostPrefixTier.evict_one is ORIGINALS[3]


# ---- the sandbox's copy of kvlib -----------------------------------------------------------------
def _stubbed(tree: Path, module: str, cls: str) -> dict:
    """For each method of ``cls`` in the copy: whether its body is only a NotImplementedError stub."""
    source = ast.parse(module_file(module, tree / "kvlib").read_text())
    node = next(n for n in source.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {f.name: len(f.body) == 1 and isinstance(f.body[0], ast.Raise) and "NotImplementedError" in ast.unparse(f)
            for f in node.body if isinstance(f, ast.FunctionDef)}


@pytest.mark.parametrize("task, module, cls, stubs", [
    (lab04.running, "kvlib.core.scheduler", "Scheduler", {"schedule_running"}),
    (lab04.waiting, "kvlib.core.scheduler", "Scheduler", {"schedule_waiting"}),
    (lab04.engine, "kvlib.core.scheduler", "Scheduler", {"schedule_running", "schedule_waiting"}),
    (lab06.swap, "kvlib.core.block_manager", "BlockManager", {"swap_out", "swap_in", "host_blocks_needed"}),
    (lab06.drop, "kvlib.core.block_manager", "BlockManager", {"drop"}),
    (lab10.tier, "kvlib.core.prefix_cache", "HostPrefixTier", {"__init__", "put", "lookup", "touch", "evict_one",
                                                          "__contains__", "__iter__", "num_cached"}),
], ids=lambda v: getattr(v, "name", None))
def test_the_sandbox_copy_stubs_exactly_the_graded_methods(task, module, cls, stubs):
    stubbed = _stubbed(stubbed_tree(task.hidden), module, cls)
    assert {name for name, stub in stubbed.items() if stub} == stubs
    assert not any(_stubbed(ROOT, module, cls).values())  # kvlib itself is untouched


# ---- kvlib's own pieces pass the checks written for the learner's ------------------------------
def _copied(base: type, names: tuple) -> type:
    """A subclass running copies of kvlib's methods, which hiding ``base``'s own does not reach."""
    def copy(f):
        return types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return type("Own", (base,), {name: copy(base.__dict__[name]) for name in names})


def test_kvlibs_own_algorithms_get_full_marks():
    scheduler = _copied(Scheduler, ("schedule_running", "schedule_waiting"))
    assert lab04.check_schedule_running(scheduler).full_marks and lab04.check_schedule_waiting(scheduler).full_marks
    block_manager = _copied(BlockManager, ("swap_out", "swap_in", "drop", "host_blocks_needed"))
    assert lab06.check_swap(block_manager).full_marks and lab06.check_drop(block_manager).full_marks
    tier = _copied(HostPrefixTier, tuple(n for n, v in vars(HostPrefixTier).items() if callable(v)))
    tier.num_cached = property(lambda self: len(self._by_name))
    assert lab10.check_tier(tier).full_marks


@pytest.mark.parametrize("seed", range(4))
def test_every_lab04_scenario_exercises_its_rule(seed):
    plans = {name: lab04._plans(Scheduler, name, random.Random(seed)) for name in lab04.SCENARIOS}
    first = plans["chunked_prefill"][0]  # a's whole prompt and b's first chunk fill the budget, both admitted
    assert first.startswith("+ a: ") and ", b: " in first and "c" not in first
    assert plans["chunked_prefill"][1].startswith("a: 1, b: ")  # a decodes, b's next chunk: schedule_running's
    assert "+ a: 33" in plans["watermark_waived"]  # a resumes alone, past the watermark
    assert "+ b: 4, c: 8" in plans["prefix_hits"]
    assert any(p.startswith("+ p: ") and "," not in p for p in plans["max_num_seqs"])  # q waits for p's samples
    assert plans["arrival_ties"] == plans["fcfs_across_queues"]  # a tie goes to the older seq_id: s
    assert plans["arrived_earlier"] != plans["nobody_overtakes"]  # w arrived first, so w goes first
    assert len({tuple(lab04._plans(Scheduler, "budget", random.Random(s))) for s in range(6)}) > 1  # seeds vary it


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


def test_a_schedule_running_that_hands_every_sequence_to_the_waiting_pass_gets_nothing():
    """kvlib's own waiting pass, which the running checks use, admitted them all again, so every step's plan came
    out as kvlib's and this scored 5 of 7; a plan now says which pass planned each chunk."""
    class HandsThemOn(Scheduler):
        def schedule_running(self, out, budget):
            for seq in list(self.running):
                self.move(seq, SequenceStatus.WAITING)
            return budget

    assert [c.status for c in lab04.running.verdicts(HandsThemOn, 3)] == ["fail"] * len(lab04.running.checks)
