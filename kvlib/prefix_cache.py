"""Prefix caching: full blocks named by what they hold, kept after use, reused by later requests.

A full block is named by a chained hash of the previous block's name and its own token ids, so
two blocks share a name only if every token before them matches too. The cache owns one
reference to each block it names; when every sequence has let go, the block stays cached but
becomes evictable, and the least recently used evictable block is the first to be reclaimed.
A hit compares the stored token ids, not only the hash.

With a host tier (tiered caching), a block evicted from the device is first copied into the host
pool, where it stays, least recently used first out, so a returning long conversation copies its
prefix back over the host link instead of recomputing it.
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


@dataclass
class PrefixHit:
    block_id: int  # a device block, or a host block when ``on_host``
    name: int
    on_host: bool = False


class PrefixCache:
    def __init__(self, allocator, host_allocator=None):
        self.allocator = allocator
        self.host_allocator = host_allocator  # None: no host tier
        self._by_hash: dict[int, CachedBlock] = {}
        self._block_hash: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # device block ids, least recently used first
        self._host: OrderedDict[int, CachedBlock] = OrderedDict()  # name -> host block, least recently used first
        self._pinned: set[int] = set()  # host blocks written or read back this step: not to be reused
        self.demotions: list[tuple[int, int]] = []  # (device, host) copies owed by this step
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_host_hit_tokens = 0

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._block_hash

    @property
    def num_cached(self) -> int:
        return len(self._block_hash)

    @property
    def num_host_cached(self) -> int:
        return len(self._host)

    def host_blocks(self) -> list[int]:
        return [entry.block_id for entry in self._host.values()]

    @property
    def num_evictable(self) -> int:
        return sum(1 for b in self._block_hash if self.allocator.ref_count(b) == 1)

    def start_step(self) -> None:
        self._pinned.clear()

    def pin(self, host_blocks: list[int]) -> None:
        """Keep these host blocks for the rest of the step (a request is about to copy them back)."""
        self._pinned.update(host_blocks)

    def release_order(self, blocks: list[int]) -> None:
        """A sequence let go of ``blocks`` (in table order): make its tail the first to be evicted.

        A prefix is only useful from its first block on, so losing the head first would waste
        every block behind it.
        """
        for block in reversed(blocks):
            if block in self._lru:
                self._lru.move_to_end(block)

    def match(self, token_ids: list[int], block_size: int) -> list[PrefixHit]:
        """The cached leading full blocks of ``token_ids``: on the device, then on the host tier."""
        hits, previous = [], None
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            tokens = tuple(token_ids[start:start + block_size])
            previous = block_hash(previous, tokens)
            cached = self._by_hash.get(previous)
            if cached is not None and cached.tokens == tokens:
                hits.append(PrefixHit(cached.block_id, previous))
                continue
            stored = self._host.get(previous)
            if stored is None or stored.tokens != tokens:
                break
            hits.append(PrefixHit(stored.block_id, previous, on_host=True))
        return hits

    def record_query(self, num_tokens: int, hits: list[PrefixHit], block_size: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += len(hits) * block_size
        self.num_host_hit_tokens += sum(block_size for h in hits if h.on_host)

    def touch(self, block_id: int) -> None:
        self._lru.move_to_end(block_id)

    def insert(self, previous: Optional[int], tokens: tuple[int, ...], block_id: int) -> int:
        """Name a freshly filled block; the cache takes a reference unless the name is already cached."""
        name = block_hash(previous, tokens)
        if name not in self._by_hash:
            self.insert_named(name, tokens, block_id)
        return name

    def promote(self, hit: PrefixHit, device_block: int) -> None:
        """A host-tier hit copied back into ``device_block``: cache it on the device again."""
        self._host.move_to_end(hit.name)
        self.insert_named(hit.name, self._host[hit.name].tokens, device_block)

    def insert_named(self, name: int, tokens: tuple[int, ...], block_id: int) -> None:
        self._by_hash[name] = CachedBlock(block_id, tokens)
        self._block_hash[block_id] = name
        self._lru[block_id] = None
        self.allocator.fork(block_id)

    def evict_one(self) -> bool:
        """Release the least recently used block that only the cache holds; False if there is none."""
        for block_id in self._lru:
            if self.allocator.ref_count(block_id) == 1:
                del self._lru[block_id]
                name = self._block_hash.pop(block_id)
                entry = self._by_hash.pop(name)
                self._demote(name, entry)
                self.allocator.free(block_id)
                return True
        return False

    def _demote(self, name: int, entry: CachedBlock) -> None:
        """Keep an evicted device block on the host tier, if there is one and it has (or makes) room."""
        if self.host_allocator is None or name in self._host:
            return
        if self.host_allocator.num_free == 0 and not self.evict_host_one():
            return
        host_block = self.host_allocator.allocate()
        self._pinned.add(host_block)
        self.demotions.append((entry.block_id, host_block))
        self._host[name] = CachedBlock(host_block, entry.tokens)

    def evict_host_one(self) -> bool:
        """Free the least recently used host-tier block not written or read back in this step."""
        for name, entry in self._host.items():
            if entry.block_id not in self._pinned:
                del self._host[name]
                self.host_allocator.free(entry.block_id)
                return True
        return False
