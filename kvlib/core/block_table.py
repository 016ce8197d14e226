"""A sequence's block table: which physical block holds each run of ``block_size`` tokens.

Token ``i`` of a sequence lives in block ``blocks[i // block_size]`` at offset ``i % block_size``;
its slot, the flat index used by the KV store, is ``block * block_size + offset``.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // block_size)


@dataclass
class BlockTable:
    block_size: int
    blocks: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def capacity(self) -> int:
        """Tokens the table can hold without another block."""
        return len(self.blocks) * self.block_size

    def num_missing_blocks(self, num_tokens: int) -> int:
        """Blocks to append before the table can hold ``num_tokens`` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.blocks))

    def append(self, block_id: int) -> None:
        self.blocks.append(block_id)

    def slot(self, position: int) -> int:
        block_index, offset = divmod(position, self.block_size)
        return self.blocks[block_index] * self.block_size + offset

    def slots(self, start: int, end: int) -> list[int]:
        """Slots of positions ``start .. end-1``."""
        return [self.slot(p) for p in range(start, end)]

    def pop_tail(self, count: int) -> list[int]:
        """Remove and return the last ``count`` blocks (the first one removed comes last)."""
        taken = self.blocks[len(self.blocks) - count:]
        del self.blocks[len(self.blocks) - count:]
        return taken
