"""Lab 05 grading: full marks for kvlib's own sharing, zero for the stubs, and a bug costs exactly its checks.

The buggy classes are graded in this process (fast); two notebooks are graded the way ``kvlib grade``
runs them: the solution and the untouched lab.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kvlib.course.grading import grade_notebook, lab05
from kvlib.course.grading.results import FAIL
from kvlib.sharing import BlockSharing

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab05_sharing.ipynb"
LAB = ROOT / "labs" / "lab05_sharing.ipynb"
ENGINE = {"engine/greedy_samples", "engine/seeded_samples", "engine/under_preemption"}


class ForkWithoutOwner(BlockSharing):
    def fork(self, allocator, blocks):  # the child reads the blocks but nobody counts it
        return list(blocks)


class ForkSharesTheTable(BlockSharing):
    def fork(self, allocator, blocks):  # one list for parent and child: appends would leak between them
        for block in blocks:
            allocator.fork(block)
        return blocks


class NeverCopies(BlockSharing):
    def make_writable(self, allocator, blocks, index, take_block):
        return None


class CopiesPrivateBlocks(BlockSharing):
    def make_writable(self, allocator, blocks, index, take_block):
        old, new = blocks[index], take_block()
        allocator.free(old)
        blocks[index] = new
        return old, new


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


class KeepsTheOldReference(BlockSharing):
    def make_writable(self, allocator, blocks, index, take_block):
        old = blocks[index]
        if allocator.ref_count(old) == 1:
            return None
        blocks[index] = take_block()
        return old, blocks[index]


class ReturnsCopyBackwards(BlockSharing):
    def make_writable(self, allocator, blocks, index, take_block):
        copy = super().make_writable(allocator, blocks, index, take_block)
        return copy and (copy[1], copy[0])


class AllocatesDirectly(BlockSharing):
    def make_writable(self, allocator, blocks, index, take_block):
        return super().make_writable(allocator, blocks, index, allocator.allocate)


def failed_checks(sharing_cls) -> set[str]:
    results = [check(sharing_cls) for check in (lab05.check_fork, lab05.check_copy_on_write, lab05.check_engine)]
    assert all(c.status == FAIL and c.hint for r in results for c in r.failed)
    return {f"{r.task}/{c.name}" for r in results for c in r.failed}


def test_kvlibs_own_sharing_gets_full_marks():
    assert failed_checks(BlockSharing) == set()


COW = {"copy_on_write/shared_block_gets_a_copy", "copy_on_write/every_writer_gets_its_own"}
BUGS = {
    ForkWithoutOwner: {"fork/one_more_owner"} | ENGINE,
    ForkSharesTheTable: {"fork/separate_tables"},
    NeverCopies: COW | {"copy_on_write/uses_take_block"} | ENGINE,
    CopiesPrivateBlocks: {"copy_on_write/private_block_untouched", "copy_on_write/every_writer_gets_its_own"},
    FreesForEveryone: COW | ENGINE,
    KeepsTheOldReference: COW | ENGINE,
    ReturnsCopyBackwards: COW | {"copy_on_write/uses_take_block"} | ENGINE,
    AllocatesDirectly: {"copy_on_write/uses_take_block"},
}


@pytest.mark.parametrize("sharing_cls", BUGS, ids=lambda cls: cls.__name__)
def test_a_bug_costs_exactly_the_checks_that_cover_it(sharing_cls):
    assert failed_checks(sharing_cls) == BUGS[sharing_cls]


def test_a_missing_copy_is_caught_by_outputs_and_copy_counts_not_by_bookkeeping():
    result = lab05.check_engine(NeverCopies)
    messages = {c.name: c.message for c in result.failed}
    assert "made 0 copy-on-write copies" in messages["greedy_samples"]
    assert "a separate request drawing" in messages["seeded_samples"]
    assert not any("engine step" in m for m in messages.values())  # reference counts stay right


def test_freeing_for_everyone_is_caught_by_the_invariants_after_the_first_write():
    result = lab05.check_engine(FreesForEveryone)
    assert all("after engine step 2: device block" in c.message for c in result.failed)


# ---- whole notebooks, as `kvlib grade` runs them -----------------------------------------------
def test_the_solution_gets_full_marks():
    report = grade_notebook(SOLUTION)
    assert report.full_marks, report.table()
    assert [(t.task, t.points) for t in report.tasks] == [("fork", 5), ("copy_on_write", 8), ("engine", 7)]


def test_the_untouched_lab_gets_zero_and_says_not_implemented():
    report = grade_notebook(LAB)
    assert report.points == 0 and report.max_points == 20
    assert report.task("fork").failed_summary() == "not implemented: MyBlockSharing.fork"
    assert report.task("copy_on_write").failed_summary() == "not implemented: MyBlockSharing.make_writable"
    assert report.task("engine").failed_summary() == "not implemented: MyBlockSharing.fork"
