"""Record and replay grade honest code in any reasonable style as it deserves, and give nothing to code that breaks
the protocol only where it is recorded.

Labs 04, 05, 06 and 10 are graded from a record of what the learner's piece did in the sandbox, done again by the
grader (``decisions.acts_on``, ``overrides.py``). A style the recorder does not foresee must not cost points: each
piece here is graded both ways, observed directly and through the record, and the verdicts must agree. Each was
found graded wrongly by a review of the first version: keyword arguments, an allocator kept from an earlier call,
an alias of a pool taken in ``__init__``, ``isinstance`` on a wrapped argument, an entry class derived from
``CachedBlock`` or shaped like it, a private block action, kvlib's actions reached through ``super()``, state
changed by hand between acts; a lazy ``fork`` gained points it had not earned.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

import pytest

from kvlib.core.block_allocator import BlockAllocator
from kvlib.core.block_manager import BlockManager
from kvlib.core.prefix_cache import CachedBlock, HostPrefixTier
from kvlib.core.scheduler import Scheduler
from kvlib.core.sequence import SequenceStatus
from kvlib.course.grading import lab04, lab05, lab06, lab10
from kvlib.course.grading.checks import observe, verdict
from kvlib.course.grading.decisions import decided, measured
from kvlib.course.grading.results import PASS

SEED = 7


def verdicts(lab, piece) -> dict:
    """Each check's verdict observed directly and graded through the record: {check: (direct, graded)}."""
    seen = {}
    for task in lab.TASKS:
        for check in task.checks:
            reference = observe(check, task.reference(), SEED)
            direct = verdict(check, observe(check, piece, SEED), reference).status
            graded = verdict(check, measured(task, check, decided(task, check, piece, SEED), SEED), reference).status
            seen[f"{task.name}/{check.name}"] = (direct, graded)
    return seen


def assert_full_marks_both_ways(lab, piece) -> None:
    seen = verdicts(lab, piece)
    assert {name: both for name, both in seen.items() if both != (PASS, PASS)} == {}


# ---- lab 05 ----------------------------------------------------------------------------------------
class SharingByKeywords:
    def fork(self, allocator, blocks):
        return [allocator.fork(block_id=block) for block in blocks]

    def make_writable(self, allocator, blocks, index, take_block):
        assert isinstance(allocator, BlockAllocator)
        if allocator.ref_count(block_id=blocks[index]) == 1:
            return None
        old, blocks[index] = blocks[index], take_block()
        allocator.free(block_id=old)
        return old, blocks[index]


class SharingThatKeepsItsAllocator(SharingByKeywords):
    """Keeps the first allocator and take_block it is given (the engine always passes the same ones)."""

    def __init__(self):
        self.allocator = self.take = None

    def fork(self, allocator, blocks):
        self.allocator = self.allocator or allocator
        return [self.allocator.fork(block) for block in blocks]

    def make_writable(self, allocator, blocks, index, take_block):
        self.allocator, self.take = self.allocator or allocator, self.take or take_block
        if self.allocator.ref_count(blocks[index]) == 1:
            return None
        old, blocks[index] = blocks[index], self.take()
        self.allocator.free(old)
        return old, blocks[index]


@pytest.mark.parametrize("piece", [SharingByKeywords, SharingThatKeepsItsAllocator], ids=lambda c: c.__name__)
def test_lab_05_sharing_in_any_honest_style_gets_full_marks_through_the_record(piece):
    assert_full_marks_both_ways(lab05, piece)


def test_a_lazy_fork_gains_nothing_from_being_recorded():
    class LazyFork(SharingByKeywords):
        def fork(self, allocator, blocks):
            return map(allocator.fork, blocks)  # an iterator: the protocol asks for a list

    seen = verdicts(lab05, LazyFork)
    assert not any(graded == PASS and direct != PASS for direct, graded in seen.values())
    assert seen["fork/one_more_owner"] == ("fail", "fail")


# ---- lab 10 ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StampedBlock(CachedBlock):
    kept_at: int = 0


class TierByKeywords:
    """An honest tier: keyword calls on the allocator, entries of a class derived from CachedBlock."""

    def __init__(self, allocator):
        assert isinstance(allocator, BlockAllocator)
        self.allocator, self.kept, self.clock = allocator, {}, 0

    def put(self, name, tokens, host_block):
        self.clock += 1
        self.kept[name] = StampedBlock(name, host_block, tokens, self.clock)

    def lookup(self, name, tokens):
        entry = self.kept.get(name)
        return entry if entry is not None and entry.tokens == tokens else None

    def touch(self, name):
        self.kept[name] = self.kept.pop(name)

    def evict_one(self):
        for name, entry in self.kept.items():
            if self.allocator.ref_count(block_id=entry.block_id) == 1:
                del self.kept[name]
                self.allocator.free(block_id=entry.block_id)
                return True
        return False

    def __contains__(self, name):
        return name in self.kept

    def __iter__(self):
        yield from list(self.kept.values())

    @property
    def num_cached(self):
        return len(self.kept)


def test_lab_10_tiers_in_any_honest_style_get_full_marks_through_the_record():
    assert_full_marks_both_ways(lab10, TierByKeywords)


def test_a_tier_whose_iter_returns_a_list_fails_both_ways():
    """``for entry in tier`` raises TypeError on it; the check's own wrapper used to hide that."""
    class ListIter(TierByKeywords):
        def __iter__(self):
            return list(self.kept.values())

    seen = verdicts(lab10, ListIter)
    assert seen["tier/keeps_and_finds_blocks"] == ("fail", "fail")
    with pytest.raises(TypeError):
        list(ListIter(BlockAllocator(4)))
    assert list(HostPrefixTier(BlockAllocator(4))) == []  # kvlib's own tier iterates, as the protocol asks


# ---- lab 06 ----------------------------------------------------------------------------------------
class MechanismsByKeywordsAndAliases(BlockManager):
    """kvlib's plainest mechanisms, written with keyword arguments, a pool alias kept in __init__, and a private
    block action."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.host = self.host_pool

    def host_blocks_needed(self, seqs, count: Optional[int] = None) -> int:
        return sum(len(seq.block_table) if count is None else count for seq in seqs)

    def swap_out(self, seq, count: Optional[int] = None) -> None:
        blocks = seq.block_table.blocks
        hosts = []
        for block in blocks if count is None else blocks[len(blocks) - count:]:
            hosts.append(self.take_host())
            self.copy_out(device_block=block, host_block=hosts[-1])
        seq.host_blocks = hosts + seq.host_blocks
        self.release(seq, count=len(hosts))

    def swap_in(self, seq) -> None:
        for host in seq.host_blocks:
            block = self.take()
            self.copy_in(host, block)
            seq.block_table.append(block)
            self.host.free(host)
        seq.host_blocks = []

    def drop(self, seq, count: Optional[int] = None) -> int:
        before = seq.num_computed_tokens
        for host in seq.host_blocks:
            self.release_host(block=host)
        seq.host_blocks = []
        self.release(seq, len(seq.block_table) if count is None else count)
        return before - seq.num_computed_tokens


def test_lab_06_mechanisms_in_any_honest_style_get_full_marks_through_the_record():
    assert_full_marks_both_ways(lab06, MechanismsByKeywordsAndAliases)


# ---- lab 04 ----------------------------------------------------------------------------------------

class StepBySuperAndByHand(lab04.engine.reference()):
    """kvlib's own step in the styles a second review found graded wrongly: actions reached through ``super()``
    and by ``Scheduler.start(self, ...)``, a make_room of its own built on ``_select_victim``/``_preempt``, the block
    manager kept under another name, a sequence admitted by hand (its status, the queue, ``running_slots``), and
    a chunk planned by ``bm.grow`` and ``out.add`` instead of ``start``."""

    def __init__(self, config, block_manager, *args, **kwargs):
        super().__init__(config, block_manager, *args, **kwargs)
        self.blocks = block_manager

    def make_room(self, seq, end, out):
        while (shortfall := self.bm.shortfall(seq, end)) > 0:
            victim = self._select_victim(seq, shortfall, out)
            count = victim.num_blocks
            if self.config.partial_preemption and victim.num_unique_tail_blocks:
                count = min(shortfall, victim.num_unique_tail_blocks)
            self._preempt(victim, count, out)
            if seq.status is not SequenceStatus.RUNNING:
                return False
        return True

    def schedule_running(self, out, budget):
        for seq in list(self.running):
            num_new = min(seq.num_uncomputed_tokens, budget) if seq.status is SequenceStatus.RUNNING else 0
            end = seq.num_computed_tokens + num_new
            if num_new and self.make_room(seq, end, out):
                if seq.pending_forks and end == seq.num_tokens:
                    super().start(seq, num_new, end, out)
                else:
                    self.blocks.grow(seq, end)
                    out.add(seq, num_new)
                budget -= num_new
        return budget

    def schedule_waiting(self, out, budget):
        for seq in sorted(self.swapped + self.waiting, key=lambda s: (s.arrival_time, s.seq_id)):
            if budget == 0 or self.running_slots + seq.num_slots > self.config.max_num_seqs:
                break
            use_watermark = bool(self.running)
            hits = [] if seq.status is SequenceStatus.SWAPPED else self.blocks.prefix_hits(seq)
            first = seq.num_computed_tokens + len(hits) * self.block_size
            num_new = min(seq.num_tokens - first, budget)
            end = first + num_new
            if seq.status is SequenceStatus.SWAPPED:
                if not self.blocks.can_swap_in(seq, end, use_watermark):
                    break
                self.blocks.swap_in(seq)
                super().move(seq, SequenceStatus.RUNNING)
            else:
                if not self.blocks.can_admit(seq, hits, end, use_watermark):
                    break
                self.blocks.admit(seq, hits)
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                bisect.insort(self.running, seq, key=lambda s: (s.arrival_time, s.seq_id))
                self.running_slots += seq.num_slots
            Scheduler.start(self, seq, num_new, end, out)
            budget -= num_new
        return budget


def test_lab_04_steps_in_any_honest_style_get_full_marks_through_the_record():
    assert_full_marks_both_ways(lab04, lab04.engine.reference())
    assert_full_marks_both_ways(lab04, StepBySuperAndByHand)


def test_a_budget_handed_on_as_a_numpy_integer_gets_full_marks_through_the_record():
    """schedule_running's answer comes back from the record as an int and is schedule_waiting's budget: the record
    had asked for it as numpy's int64, and the replay refused the record as answering other questions."""
    import numpy as np

    class NumpyBudget(lab04.engine.reference()):
        def schedule_running(self, out, budget):
            return np.int64(super().schedule_running(out, budget))
    assert_full_marks_both_ways(lab04, NumpyBudget)
