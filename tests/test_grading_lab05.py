"""Lab 05 grading: the engine checks catch what bookkeeping cannot, and kvlib's own sharing is refused.

The realistic bugs are test data in ``tests/lab_bugs/lab05.py`` (``test_labs_graded.py`` grades them).
Here: a missing copy is caught by the tokens and the copy count while every reference count stays
right; freeing a shared block for everyone is caught by the invariants right after the first write;
importing kvlib's ``BlockSharing`` scores zero; two notebooks graded the way ``kvlib grade`` runs them.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kvlib.course.grading import grade_notebook, lab05
from kvlib.course.grading.extract import extract
from kvlib.sharing import BlockSharing

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab05_sharing.ipynb"
LAB = ROOT / "labs" / "lab05_sharing.ipynb"


class NeverCopies(BlockSharing):
    def make_writable(self, allocator, blocks, index, take_block):
        return None


class FreesForEveryone(BlockSharing):
    def make_writable(self, allocator, blocks, index, take_block):
        old = blocks[index]
        if allocator.ref_count(old) == 1:
            return None
        new = take_block()
        while allocator.ref_count(old):
            allocator.free(old)
        blocks[index] = new
        return old, new


def test_kvlibs_own_sharing_gets_full_marks():
    for check in (lab05.check_fork, lab05.check_copy_on_write, lab05.check_engine):
        assert check(BlockSharing).full_marks


def test_a_missing_copy_is_caught_by_outputs_and_copy_counts_not_by_bookkeeping():
    result = lab05.check_engine(NeverCopies)
    messages = {c.name: c.message for c in result.failed}
    assert "made 0 copy-on-write copies" in messages["greedy_samples"]
    assert "a separate request drawing" in messages["seeded_samples"]
    assert "with prefix caching" in messages["with_prefix_caching"]
    assert not any("engine step" in m for m in messages.values())  # reference counts stay right


def test_freeing_for_everyone_is_caught_by_the_invariants_after_the_first_write():
    result = lab05.check_engine(FreesForEveryone)
    messages = [c.message for c in result.failed if c.name != "with_prefix_caching"]
    assert messages and all("after engine step 2: device block" in m for m in messages)


@pytest.mark.parametrize("source", [
    "from kvlib.sharing import BlockSharing\nMyBlockSharing = BlockSharing",
    "from kvlib.sharing import BlockSharing\n\nclass MyBlockSharing(BlockSharing):\n"
    "    def fork(self, a, b):\n        return super().fork(a, b)\n    def make_writable(self, a, b, i, t):\n"
    "        return None",
])
def test_kvlibs_own_sharing_is_refused(source):
    violations = extract([source], lab05.RULES).violations
    assert any("imports BlockSharing from kvlib.sharing" in v for v in violations), violations


# ---- whole notebooks, as `kvlib grade` runs them -----------------------------------------------
def test_the_solution_gets_full_marks():
    report = grade_notebook(SOLUTION)
    assert report.full_marks, report.table()
    assert [(t.task, t.points) for t in report.tasks] == [("fork", 5), ("copy_on_write", 8), ("engine", 9)]


def test_the_untouched_lab_gets_zero_and_says_not_implemented():
    report = grade_notebook(LAB)
    assert report.points == 0 and report.max_points == 22
    assert report.task("fork").failed_summary() == "not implemented: MyBlockSharing.fork"
    assert report.task("copy_on_write").failed_summary() == "not implemented: MyBlockSharing.make_writable"
    assert report.task("engine").failed_summary() == "not implemented: MyBlockSharing.fork"
