"""Labs 07 and 09 (victim choice; metrics and the oversubscription detector) grade as intended.

The realistic bugs of labs 07 and 09 are test data in ``tests/lab_bugs`` (``test_labs_graded.py``
grades them); here: the graders' own machinery (lab 07 replays the reference on the learner's
episodes, lab 09 replays recorded runs to a detector) agrees with the engine, a design other than
the solution's but as good gets full marks, kvlib's own pieces are refused, and a few notebooks
are graded the way ``kvlib grade`` does, in the sandbox.
"""
from __future__ import annotations

from collections import deque
from pathlib import Path

import nbformat
import pytest

from kvlib.course.grading import grade_notebook, lab07, lab09
from kvlib.course.grading.extract import extract
from kvlib.course.grading.results import FAIL, NOT_IMPLEMENTED
from kvlib.course.labs import remove_hidden_tests
from kvlib.oversubscription import OversubscriptionDetector
from kvlib.preemption import LatestArrivalPolicy, SparingPolicy

ROOT = Path(__file__).resolve().parents[1]


def _failed(*results) -> list[str]:
    failed = [c for result in results for c in result.failed]
    assert all(c.status == FAIL and c.hint for c in failed)
    return [c.name for c in failed]


# ---- lab 07: victim choice -----------------------------------------------------------------------
def test_lab07_the_reference_gets_full_marks_and_its_replay_is_what_the_engine_did():
    assert lab07.check_select_victim(SparingPolicy).full_marks
    assert lab07.check_engine(SparingPolicy).full_marks
    for workload in lab07.WORKLOADS:
        run = lab07._run(SparingPolicy, workload)
        assert sum(e.shortfall > 1 for e in run.episodes) >= 1, workload.name
        for episode in run.episodes:
            replayed = lab07.replay(SparingPolicy(), episode.candidates, episode.shortfall)
            assert [(v.seq, v.num_unique_tail_blocks) for v in replayed] == \
                   [(v.seq, v.num_unique_tail_blocks) for v in episode.victims]


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


def test_lab07_another_design_as_good_as_the_reference_gets_full_marks():
    assert lab07.check_select_victim(HoldersFirst).full_marks
    assert lab07.check_engine(HoldersFirst).full_marks


def test_lab07_preempting_shared_blocks_first_costs_its_engine_points():
    failed = _failed(lab07.check_engine(MostSharedFirst))
    assert "covers_multi_block_shortfalls" in failed
    message = next(c.message for c in lab07.check_engine(MostSharedFirst).failed)
    assert "shortfalls of several blocks cost" in message and "would do" in message


def test_lab07_a_stub_scores_zero_as_not_implemented():
    class Stub(LatestArrivalPolicy):
        def select_victim(self, candidates, shortfall):
            raise NotImplementedError("MyVictimPolicy.select_victim")
    for result in (lab07.check_select_victim(Stub), lab07.check_engine(Stub)):
        assert result.points == 0 and {c.status for c in result.checks} == {NOT_IMPLEMENTED}


# ---- lab 09: the report and the detector ------------------------------------------------------------
class CounterDeltas:
    """Another design: preemptions since the moment 16 fewer requests had finished, from the counters alone."""

    def __init__(self, threshold: float = 1.0):
        self.threshold, self.marks, self.warned = threshold, deque(), False

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


def test_lab09_a_design_over_counter_deltas_gets_full_marks():
    assert lab09.check_detector(CounterDeltas).full_marks
    assert lab09.check_engine(CounterDeltas).full_marks


def test_lab09_the_whole_run_average_misses_a_late_onset_only():
    assert _failed(lab09.check_detector(OversubscriptionDetector), lab09.check_engine(OversubscriptionDetector)) == [
        "judges_recent_requests", "warns_on_late_onset"]


@pytest.mark.parametrize("workload", ["late", "occasional"])
def test_lab09_a_replayed_run_shows_a_detector_what_the_engine_would(workload):
    live, replayed = lab09._live(CounterDeltas, workload), lab09._replayed(CounterDeltas, workload)
    assert live.warnings == replayed.warnings
    assert (live.metrics.num_preemptions, live.metrics.num_steps) == (replayed.metrics.num_preemptions,
                                                                      replayed.metrics.num_steps)


def test_lab09_the_report_of_a_real_run_matches_the_graders_own_and_summary_is_refused():
    def delegating(metrics, window=16):
        return metrics.summary()
    result = lab09.check_report(delegating)
    assert result.points == 0
    assert all("kvlib's own report" in c.message for c in result.failed)
    assert lab09.check_report(lab09.reference_report).full_marks


# ---- kvlib's own pieces are refused ------------------------------------------------------------------
@pytest.mark.parametrize("lab, task, source, why", [
    ("lab07", "select_victim", "from kvlib.preemption import SparingPolicy\nMyVictimPolicy = SparingPolicy",
     "imports SparingPolicy from kvlib.preemption"),
    ("lab07", "engine", "from kvlib.preemption import SparingPolicy\n\nclass MyVictimPolicy(SparingPolicy):\n"
                        "    def select_victim(self, c, s):\n        return super().select_victim(c, s)",
     "imports SparingPolicy"),
    ("lab09", "detector", "from kvlib.oversubscription import OversubscriptionDetector\n\n"
                          "class MyOversubscriptionDetector(OversubscriptionDetector):\n    def __init__(self):\n"
                          "        pass\n    def observe(self, m):\n        return None",
     "imports OversubscriptionDetector from kvlib.oversubscription"),
    ("lab09", "report", "from kvlib.metrics import percentile\n\ndef preemption_report(metrics, window=16):\n"
                        "    return percentile([], 50)", "imports percentile from kvlib.metrics"),
])
def test_a_task_answered_with_kvlibs_own_implementation_is_refused(lab, task, source, why):
    tasks = {t.name: t for t in {"lab07": lab07, "lab09": lab09}[lab].TASKS}
    violations = extract([source], tasks[task].rules).violations
    assert any(why in v for v in violations), violations


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
    report = grade_notebook(ROOT / "solutions" / "lab07_victim_selection.ipynb")
    assert report.full_marks, report.table()
    assert [(t.task, t.points) for t in report.tasks] == [("select_victim", 6), ("engine", 8)]


def test_lab09_a_warning_every_step_loses_the_once_checks_in_the_sandbox(tmp_path):
    solution = ROOT / "solutions" / "lab09_preemption_metrics.ipynb"
    report = grade_notebook(_with_bug(tmp_path, solution, "        self.warned = True\n", ""))
    assert report.failed_checks() == {"detector/warns_once", "engine/warns_once_when_oversubscribed"}, report.table()
    assert (report.points, report.max_points) == (22 - 1 - 2, 22)
