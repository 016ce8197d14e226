"""Labs 07 and 09 (victim choice; metrics and the oversubscription detector) grade as intended.

The realistic bugs of labs 07 and 09 are test data in ``tests/lab_bugs`` (``test_labs_graded.py``
grades them); here: the graders' own machinery (lab 07 replays a policy on recorded engine states,
lab 09 replays recorded runs to a detector) agrees with the engine, a design other than the
solution's but as good gets full marks, leaning on kvlib's own pieces gets "not implemented", and
two notebooks are graded the way ``kvlib grade`` does, in the sandbox.
"""
from __future__ import annotations

import random
from collections import deque
from pathlib import Path

import nbformat

from kvlib.core.oversubscription import OversubscriptionDetector
from kvlib.core.preemption import LatestArrivalPolicy, SparingPolicy
from kvlib.course.grading import grade_notebook, lab07, lab09
from kvlib.course.grading.results import FAIL, NOT_IMPLEMENTED
from kvlib.course.grading.workloads import serve_watched
from kvlib.course.labs import remove_hidden_tests

ROOT = Path(__file__).resolve().parents[1]


def _failed(*results) -> list[str]:
    failed = [c for result in results for c in result.failed]
    assert all(c.status == FAIL and c.hint for c in failed)
    return [c.name for c in failed]


def _statuses(*results) -> set[str]:
    return {c.status for result in results for c in result.checks}


# ---- lab 07: victim choice -----------------------------------------------------------------------
class HoldersFirst(LatestArrivalPolicy):
    """Another design: paused holders have already stalled, so their tails go before a running one's."""

    def select_victim(self, candidates, shortfall):
        requester = next(c for c in candidates if c.is_requester)
        givers = [c for c in candidates if not c.is_requester and c.num_unique_tail_blocks > 0]
        covering = [c for c in givers if c.num_unique_tail_blocks >= shortfall]
        pool = covering or givers
        paused = [c for c in pool if not c.running]
        if paused and covering:
            return paused[-1]
        return (pool or [requester])[-1]


class MostSharedFirst(LatestArrivalPolicy):
    """Lesson 08's mistake: the candidate with the most shared blocks (the newest among ties)."""

    def select_victim(self, candidates, shortfall):
        return max(reversed(candidates), key=lambda c: c.num_shared_blocks)


class LeansOnSparing(SparingPolicy):
    def select_victim(self, candidates, shortfall):
        return super().select_victim(candidates, shortfall)


def test_lab07_the_recorded_states_hold_multi_block_shortfalls_and_replay_like_the_engine():
    for workload in lab07.WORKLOADS:
        episodes = lab07._recorded(workload, 0)
        assert sum(e[1] > 1 for e in episodes) >= 1, workload
        # the default policy takes the newest each call: its replay ends when the shortfall is covered
        for _, shortfall, candidates in episodes:
            victims = lab07.replay(LatestArrivalPolicy(), candidates, shortfall)
            assert victims[-1].is_requester or sum(min(v.num_unique_tail_blocks, shortfall) for v in victims) >= 1


def test_lab07_the_scenarios_draw_their_inputs_from_the_seed():
    check = lab07.select_victim.named("nobody_covers_alone")
    assert len({str(check.scenario(SparingPolicy, random.Random(seed))) for seed in range(4)}) > 1


def test_lab07_another_design_as_good_as_the_reference_gets_full_marks():
    assert lab07.check_select_victim(HoldersFirst).full_marks
    assert lab07.check_engine(HoldersFirst).full_marks


def test_lab07_preempting_shared_blocks_first_costs_its_engine_points():
    result = lab07.check_engine(MostSharedFirst)
    assert "covers_multi_block_shortfalls" in _failed(result)
    message = next(c.message for c in result.failed if c.name == "covers_multi_block_shortfalls")
    assert "victims taken" in message and "no more allowed" not in message and "allowed" in message


def test_lab07_a_stub_or_kvlibs_own_policy_scores_zero_as_not_implemented():
    class Stub(LatestArrivalPolicy):
        def select_victim(self, candidates, shortfall):
            raise NotImplementedError("MyVictimPolicy.select_victim")
    for policy in (Stub, LeansOnSparing, SparingPolicy):
        results = (lab07.check_select_victim(policy), lab07.check_engine(policy))
        assert sum(r.points for r in results) == 0 and _statuses(*results) == {NOT_IMPLEMENTED}


# ---- lab 09: the report and the detector ------------------------------------------------------------
class CounterDeltas:
    """Another design: preemptions since the moment 16 fewer requests had finished, from the counters alone."""

    def __init__(self, threshold: float = 1.0):
        self.threshold, self.marks, self.warned = threshold, deque([(0, 0)]), False  # nothing seen yet

    def observe(self, metrics):
        self.marks.append((metrics.num_finished, metrics.num_preemptions))
        while len(self.marks) > 1 and metrics.num_finished - self.marks[1][0] >= 16:
            self.marks.popleft()
        finished = metrics.num_finished - self.marks[0][0]
        if self.warned or finished < 8:
            return None
        rate = (metrics.num_preemptions - self.marks[0][1]) / finished
        if rate <= self.threshold:
            return None
        self.warned = True
        return f"oversubscribed ({rate:.1f} per request): raise num_gpu_blocks or lower max_num_seqs"


class WholeRun:
    """kvlib's own design, written out: the whole-run average."""

    def __init__(self):
        self.warned = False

    def observe(self, metrics):
        if self.warned or metrics.num_finished < 8 or metrics.num_preemptions / metrics.num_finished <= 1.0:
            return None
        self.warned = True
        return f"{metrics.num_preemptions / metrics.num_finished:.1f} per request: num_gpu_blocks or max_num_seqs"


def test_lab09_a_design_over_counter_deltas_gets_full_marks():
    assert lab09.check_detector(CounterDeltas).full_marks
    assert lab09.check_engine(CounterDeltas).full_marks


class SlottedCounterDeltas:
    """CounterDeltas with ``__slots__``: the protocol asks only for ``observe``, so the harness may set nothing on
    a detector."""

    __slots__ = ("threshold", "marks", "warned")
    __init__, observe = CounterDeltas.__init__, CounterDeltas.observe


def test_lab09_a_detector_with_slots_gets_full_marks():
    assert not hasattr(SlottedCounterDeltas(), "__dict__")
    assert lab09.check_detector(SlottedCounterDeltas).full_marks
    assert lab09.check_engine(SlottedCounterDeltas).full_marks


def test_lab09_the_whole_run_average_misses_a_late_onset_only():
    assert _failed(lab09.check_detector(WholeRun), lab09.check_engine(WholeRun)) == [
        "judges_recent_requests", "warns_on_late_onset"]


def test_lab09_a_replayed_run_shows_a_detector_what_the_engine_would():
    for workload in ("late", "occasional"):
        live = serve_watched(CounterDeltas(), *lab09._workload(workload, 3), lab09.MAX_STEPS)
        replayed = lab09.watch(CounterDeltas, workload, 3)
        assert [w[:2] for w in live.warnings] == [w[:2] for w in replayed.warnings]
        assert (live.metrics.num_preemptions, live.metrics.num_steps) == (replayed.metrics.num_preemptions,
                                                                          replayed.metrics.num_steps)


def test_lab09_leaning_on_kvlib_gets_not_implemented():
    class Leans(OversubscriptionDetector):
        pass
    assert _statuses(lab09.check_detector(Leans), lab09.check_engine(OversubscriptionDetector)) == {NOT_IMPLEMENTED}
    result = lab09.check_report(lambda metrics, window=16: metrics.summary())
    assert result.points == 0 and _statuses(result) == {NOT_IMPLEMENTED}
    assert lab09.check_report(lab09._reference_report()).full_marks


# ---- whole notebooks, as `kvlib grade` runs them -----------------------------------------------------
def _with_bug(tmp_path: Path, solution: Path, old: str, new: str) -> Path:
    """A learner's copy of ``solution``: hidden tests removed, ``old`` (present once) replaced by ``new``."""
    nb = nbformat.read(solution, as_version=4)
    for cell in nb.cells:
        cell.source = remove_hidden_tests(cell.source)
    [cell] = [c for c in nb.cells if old in c.source]
    assert cell.source.count(old) == 1
    cell.source = cell.source.replace(old, new)
    nbformat.write(nb, tmp_path / solution.name)
    return tmp_path / solution.name


def test_lab07_solution_gets_full_marks_in_the_sandbox():
    report = grade_notebook(ROOT / "solutions" / "lab07_victim_selection.ipynb", seed=11)
    assert report.full_marks, report.table()
    assert [(t.task, t.points) for t in report.tasks] == [("select_victim", 6), ("engine", 8)]


def test_lab09_a_warning_every_step_loses_the_once_checks_in_the_sandbox(tmp_path):
    solution = ROOT / "solutions" / "lab09_preemption_metrics.ipynb"
    report = grade_notebook(_with_bug(tmp_path, solution, "        self.warned = True\n", ""), seed=11)
    assert {"detector/warns_once", "engine/warns_once_when_oversubscribed"} <= report.failed_checks(), report.table()
    assert report.max_points == 22 and report.points <= 22 - 1 - 2
