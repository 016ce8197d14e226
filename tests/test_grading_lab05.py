"""Lab 05 grading: the engine checks catch what bookkeeping cannot, and kvlib's own sharing is hidden.

The realistic bugs are test data in ``tests/lab_bugs/lab05.py`` (``test_labs_graded.py`` grades them).
Here: a correct sharing written from scratch gets full marks on several seeds; a missing copy is
caught by the tokens and the copy count while every reference count stays right; freeing a shared
block for everyone is caught by the invariants right after the first write; leaning on kvlib's
``BlockSharing`` gets "not implemented"; the solution graded the way ``kvlib grade`` runs it.
"""
from __future__ import annotations

import random
from pathlib import Path

from kvlib.core.sharing import BlockSharing
from kvlib.course.grading import grade_notebook, lab05
from kvlib.course.grading.results import NOT_IMPLEMENTED

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab05_sharing.ipynb"


class Correct:
    def fork(self, allocator, blocks):
        child = []
        for block in blocks:
            allocator.fork(block)
            child.append(block)
        return child

    def make_writable(self, allocator, blocks, index, take_block):
        if allocator.ref_count(blocks[index]) < 2:
            return None
        old, blocks[index] = blocks[index], take_block()
        allocator.free(old)
        return old, blocks[index]


class NeverCopies(Correct):
    def make_writable(self, allocator, blocks, index, take_block):
        return None


class FreesForEveryone(Correct):
    def make_writable(self, allocator, blocks, index, take_block):
        old = blocks[index]
        if allocator.ref_count(old) == 1:
            return None
        new = take_block()
        while allocator.ref_count(old):
            allocator.free(old)
        blocks[index] = new
        return old, new


class LeansOnKvlib(BlockSharing):
    def fork(self, allocator, blocks):
        return super().fork(allocator, blocks)


def test_a_correct_sharing_gets_full_marks_on_any_seed():
    for seed in (1, 7):
        for task in (lab05.fork, lab05.copy_on_write):
            assert all(r.status == "pass" for r in task.verdicts(Correct, seed)), (seed, task.name)
    assert lab05.check_engine(Correct).full_marks


def test_the_inputs_vary_with_the_seed():
    check = lab05.fork.named("same_blocks")
    seen = {str(check.scenario(BlockSharing, random.Random(seed))) for seed in range(5)}
    assert len(seen) > 1


def test_a_missing_copy_is_caught_by_outputs_and_copy_counts_not_by_bookkeeping():
    result = lab05.check_engine(NeverCopies)
    messages = {c.name: c.message for c in result.failed}
    assert set(messages) >= {"greedy_samples", "seeded_samples", "with_prefix_caching"}
    assert "copy-on-write copies: yours is 0" in messages["greedy_samples"]
    assert "tokens of each request's samples" in messages["seeded_samples"]
    assert not any("engine step" in m for m in messages.values())  # reference counts stay right


def test_freeing_for_everyone_is_caught_by_the_invariants_after_the_first_write():
    result = lab05.check_engine(FreesForEveryone)
    messages = {c.name: c.message for c in result.failed}
    assert len(messages) == 4
    assert all("after engine step 2: device block" in messages[name] for name in ("greedy_samples", "seeded_samples"))


def test_leaning_on_kvlibs_own_sharing_is_not_implemented():
    assert {c.status for c in lab05.check_fork(LeansOnKvlib).checks} == {NOT_IMPLEMENTED}
    assert {c.status for c in lab05.check_copy_on_write(BlockSharing).checks} == {NOT_IMPLEMENTED}


def test_the_solution_gets_full_marks_in_the_sandbox():
    report = grade_notebook(SOLUTION, seed=5)
    assert report.full_marks, report.table()
    assert [(t.task, t.points) for t in report.tasks] == [("fork", 5), ("copy_on_write", 8), ("engine", 9)]


class KeepsTheOldReference(Correct):
    """Calls take_block() as it should, but never gives up the writer's reference to the old block."""

    def make_writable(self, allocator, blocks, index, take_block):
        if allocator.ref_count(blocks[index]) < 2:
            return None
        old, blocks[index] = blocks[index], take_block()
        return old, blocks[index]


class AllocatesItself(Correct):
    def make_writable(self, allocator, blocks, index, take_block):
        if allocator.ref_count(blocks[index]) < 2:
            return None
        old, blocks[index] = blocks[index], allocator.allocate()
        allocator.free(old)
        return old, blocks[index]


def test_each_copy_on_write_hint_names_the_mistake_its_check_saw():
    """An attempt that called take_block() but kept its reference to the old block failed uses_take_block with the
    hint "get the new block by calling take_block(), never allocator.allocate()", which it did."""
    for seed in (1, 7):
        failed = {r.name: r for r in lab05.copy_on_write.verdicts(KeepsTheOldReference, seed) if r.status != "pass"}
        assert "uses_take_block" not in failed, failed["uses_take_block"].message
        assert set(failed) == {"shared_block_gets_a_copy", "every_writer_gets_its_own"}, (seed, set(failed))
        assert all("reference" in r.hint for r in failed.values()), [r.hint for r in failed.values()]
        allocating = {r.name: r for r in lab05.copy_on_write.verdicts(AllocatesItself, seed) if r.status != "pass"}
        assert "uses_take_block" in allocating and "every_writer_gets_its_own" not in allocating, (seed, set(allocating))
        assert "never allocator.allocate()" in allocating["uses_take_block"].hint
