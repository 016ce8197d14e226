"""Sharing blocks safely: fork a block table by reference, copy a shared block before writing it.

Pass your own object with these two methods as ``LLM(..., block_sharing=...)``.
"""
from __future__ import annotations

from typing import Callable, Optional


class BlockSharing:
    def fork(self, allocator, blocks: list[int]) -> list[int]:
        """A child's table: the same blocks, each with one more owner. No KV is copied."""
        return [allocator.fork(block) for block in blocks]

    def make_writable(self, allocator, blocks: list[int], index: int,
                      take_block: Callable[[], int]) -> Optional[tuple[int, int]]:
        """Before writing into ``blocks[index]``: if others share it, swap in a private copy.

        Returns the (source, destination) copy the engine must make, or None when the block is
        already private. Only the writer gets the copy; the other owners keep the original.
        """
        old = blocks[index]
        if allocator.ref_count(old) == 1:
            return None
        new = take_block()
        allocator.free(old)
        blocks[index] = new
        return old, new
