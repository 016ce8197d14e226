"""The block allocator: who owns each fixed-size KV block of one pool.

Paging turns KV memory into a pool of equal blocks, so allocation is a free list and sharing
is a reference count. The same class manages the device pool and the host (swap) pool.
Any object with this interface can be passed to ``LLM(..., allocator=...)``.
"""
from __future__ import annotations

from collections import deque
from enum import Enum


class AllocStatus(Enum):
    """The admission answer for a request that needs some blocks."""

    OK = "ok"  # enough free blocks now, above the watermark
    LATER = "later"  # not now: wait for other requests to finish or be preempted
    NEVER = "never"  # more blocks than the whole pool: the request can never run


class BlockAllocatorError(RuntimeError):
    """A bookkeeping mistake: double free, freeing an unowned block, or an exhausted pool."""


class BlockAllocator:
    """Free list plus reference counts over ``num_blocks`` block ids ``0 .. num_blocks-1``."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int, watermark_blocks: int = 0) -> AllocStatus:
        """Admission check: keep ``watermark_blocks`` free so running sequences can still grow."""
        if num_blocks > self.num_blocks - watermark_blocks:
            return AllocStatus.NEVER
        if self.num_free - num_blocks >= watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self) -> int:
        if not self._free:
            raise BlockAllocatorError(f"no free block left in a pool of {self.num_blocks}")
        block_id = self._free.popleft()
        self._ref_counts[block_id] = 1
        return block_id

    def fork(self, block_id: int) -> int:
        """Share a block with one more owner; returns the same id."""
        self._check_owned(block_id, "fork")
        self._ref_counts[block_id] += 1
        return block_id

    def free(self, block_id: int) -> None:
        """Drop one owner; the block returns to the free list when nobody owns it."""
        self._check_owned(block_id, "free")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free.append(block_id)

    def _check_owned(self, block_id: int, action: str) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise BlockAllocatorError(f"cannot {action} block {block_id}: ids run from 0 to {self.num_blocks - 1}")
        if self._ref_counts[block_id] == 0:
            raise BlockAllocatorError(f"cannot {action} block {block_id}: it is free (double free or never allocated)")
