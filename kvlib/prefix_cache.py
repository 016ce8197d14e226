"""Prefix caching: full blocks named by what they hold, kept after use, reused by later requests.

A full block is named by a chained hash of the previous block's name and its own token ids, so
two blocks share a name only if every token before them matches too. The cache owns one
reference to each block it names; when every sequence has let go, the block stays cached but
becomes evictable, and the least recently used evictable block is the first to be reclaimed.
A hit compares the stored token ids, not only the hash.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


def block_hash(previous: Optional[int], token_ids: tuple[int, ...]) -> int:
    return hash((previous, token_ids))


@dataclass
class CachedBlock:
    block_id: int
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self, allocator):
        self.allocator = allocator
        self._by_hash: dict[int, CachedBlock] = {}
        self._block_hash: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # block ids, least recently used first
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._block_hash

    @property
    def num_cached(self) -> int:
        return len(self._block_hash)

    @property
    def num_evictable(self) -> int:
        return sum(1 for b in self._block_hash if self.allocator.ref_count(b) == 1)

    def match(self, token_ids: list[int], block_size: int) -> list[tuple[int, int]]:
        """(block id, name) of the cached blocks holding the leading full blocks of ``token_ids``."""
        hits, previous = [], None
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            tokens = tuple(token_ids[start:start + block_size])
            previous = block_hash(previous, tokens)
            cached = self._by_hash.get(previous)
            if cached is None or cached.tokens != tokens:
                break
            hits.append((cached.block_id, previous))
        return hits

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def touch(self, block_id: int) -> None:
        self._lru.move_to_end(block_id)

    def insert(self, previous: Optional[int], tokens: tuple[int, ...], block_id: int) -> int:
        """Name a freshly filled block; the cache takes a reference unless the name is already cached."""
        name = block_hash(previous, tokens)
        if name not in self._by_hash:
            self._by_hash[name] = CachedBlock(block_id, tokens)
            self._block_hash[block_id] = name
            self._lru[block_id] = None
            self.allocator.fork(block_id)
        return name

    def evict_one(self) -> bool:
        """Release the least recently used block that only the cache holds; False if there is none."""
        for block_id in self._lru:
            if self.allocator.ref_count(block_id) == 1:
                del self._lru[block_id]
                del self._by_hash[self._block_hash.pop(block_id)]
                self.allocator.free(block_id)
                return True
        return False
