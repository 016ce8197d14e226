"""Labs 06-08 (victim selection, the auto policy, the oversubscription detector) grade as intended.

Buggy pieces are graded in this process, each losing exactly the checks that cover its bug; the
deliberately bad ones prove that the engine checks can fail. Three notebooks are graded the way
``kvlib grade`` does: lab 06's solution, lab 07 untouched, and lab 08's solution with one bug.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from kvlib.course.grading import grade_notebook, lab07, lab09
from kvlib.course.grading.results import FAIL
from kvlib.course.labs import remove_hidden_tests
from kvlib.oversubscription import OversubscriptionDetector
from kvlib.preemption import LatestArrivalPolicy

ROOT = Path(__file__).resolve().parents[1]


def _failed(*results) -> list[str]:
    failed = [c for result in results for c in result.failed]
    assert all(c.status == FAIL and c.hint for c in failed)
    return [c.name for c in failed]


# ---- lab 06: select_victim ---------------------------------------------------------------------
class FirstCovering(LatestArrivalPolicy):
    def select_victim(self, candidates, shortfall):  # the oldest of the equals, not the newest
        requester = next(c for c in candidates if c.is_requester)
        givers = [c for c in candidates if c is not requester and c.num_unique_tail_blocks > 0]
        covering = [c for c in givers if c.num_unique_tail_blocks >= shortfall]
        return (covering or givers or [requester])[0]


class IgnoresCoverage(LatestArrivalPolicy):
    def select_victim(self, candidates, shortfall):
        requester = next(c for c in candidates if c.is_requester)
        givers = [c for c in candidates if c is not requester and c.num_unique_tail_blocks > 0]
        return (givers or [requester])[-1]


class CountsSharedBlocks(LatestArrivalPolicy):
    def select_victim(self, candidates, shortfall):  # num_blocks includes blocks that free nothing
        requester = next(c for c in candidates if c.is_requester)
        givers = [c for c in candidates if c is not requester and c.num_blocks > 0]
        covering = [c for c in givers if c.num_blocks >= shortfall]
        return (covering or givers or [requester])[-1]


class OldestIsRequester(LatestArrivalPolicy):
    def select_victim(self, candidates, shortfall):  # an older paused holder is not the requester
        requester = candidates[0]
        givers = [c for c in candidates if c is not requester and c.num_unique_tail_blocks > 0]
        covering = [c for c in givers if c.num_unique_tail_blocks >= shortfall]
        return (covering or givers or [requester])[-1]


class AlwaysRequester(LatestArrivalPolicy):
    def select_victim(self, candidates, shortfall):
        return next(c for c in candidates if c.is_requester)


def test_the_reference_policy_gets_full_marks():
    assert lab07.check_select_victim(lab07.ReferencePolicy).full_marks
    assert lab07.check_engine(lab07.ReferencePolicy).full_marks


@pytest.mark.parametrize("policy, failed", [
    (LatestArrivalPolicy, ["prefers_covering_tail", "never_all_shared", "requester_last_resort"]),
    (FirstCovering, ["newest_among_equals"]),
    (IgnoresCoverage, ["prefers_covering_tail"]),
    (CountsSharedBlocks, ["never_all_shared", "requester_last_resort"]),
    (OldestIsRequester, ["requester_last_resort"]),
    (AlwaysRequester, ["prefers_covering_tail", "newest_among_equals", "never_all_shared", "requester_last_resort"]),
])
def test_lab06_a_bug_costs_exactly_its_checks(policy, failed):
    assert _failed(lab07.check_select_victim(policy), lab07.check_engine(policy)) == failed


# ---- lab 08: the detector ----------------------------------------------------------------------
class WarnsEveryTime(OversubscriptionDetector):
    def observe(self, metrics):
        self.warned = False
        return super().observe(metrics)


class CountsTotal(OversubscriptionDetector):
    def observe(self, metrics):  # total preemptions, not per finished request
        if self.warned or metrics.num_finished < self.min_finished or metrics.num_preemptions <= self.threshold:
            return None
        self.warned = True
        return "oversubscribed: raise num_gpu_blocks or lower max_num_seqs"


class NoMinimum(OversubscriptionDetector):
    def observe(self, metrics):  # judges from the first finished request
        if self.warned or metrics.num_finished == 0 or metrics.num_preemptions / metrics.num_finished <= self.threshold:
            return None
        self.warned = True
        return "oversubscribed: raise num_gpu_blocks or lower max_num_seqs"


class AtThreshold(OversubscriptionDetector):
    def observe(self, metrics):
        if self.warned or metrics.num_finished < self.min_finished:
            return None
        if metrics.num_preemptions / metrics.num_finished < self.threshold:
            return None
        self.warned = True
        return "oversubscribed: raise num_gpu_blocks or lower max_num_seqs"


class OneRemedy(OversubscriptionDetector):
    def observe(self, metrics):
        return super().observe(metrics) and "oversubscribed: raise num_gpu_blocks"


def test_the_engine_detector_gets_full_marks():
    assert lab09.check_detector(OversubscriptionDetector).full_marks
    assert lab09.check_engine(OversubscriptionDetector).full_marks


@pytest.mark.parametrize("detector, failed", [
    (WarnsEveryTime, ["warns_once", "warns_once_when_oversubscribed"]),
    (CountsTotal, ["rate_above_threshold"]),
    (NoMinimum, ["quiet_until_min_finished"]),
    (AtThreshold, ["rate_above_threshold"]),
    (OneRemedy, ["names_both_remedies"]),
])
def test_lab08_a_bug_costs_exactly_its_checks(detector, failed):
    assert _failed(lab09.check_detector(detector), lab09.check_engine(detector)) == failed


# ---- whole notebooks, as `kvlib grade` runs them -----------------------------------------------
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


def test_lab06_solution_gets_full_marks():
    report = grade_notebook(ROOT / "solutions" / "lab07_victim_selection.ipynb")
    assert report.full_marks, report.table()
    assert [(t.task, t.points) for t in report.tasks] == [("select_victim", 6), ("engine", 4)]


def test_lab08_warning_every_step_loses_the_once_checks(tmp_path):
    solution = ROOT / "solutions" / "lab09_preemption_metrics.ipynb"
    report = grade_notebook(_with_bug(tmp_path, solution, "        self.warned = True\n", ""))
    assert report.failed_checks() == {"detector/warns_once", "engine/warns_once_when_oversubscribed"}, report.table()
    assert (report.points, report.max_points) == (5, 8)
