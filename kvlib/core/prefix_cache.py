"""Prefix caching: full blocks named by what they hold, kept after use, reused by later requests.

A full block is named by a chained hash of the previous block's name and its own token ids, so
two blocks share a name only if every token before them matches too. A hit compares the stored
token ids, not only the hash. The cache owns one reference to each block it names; once every
sequence has let go, the block is *evictable*: still cached, but counted as free, and the least
recently released one is reclaimed first. A sequence's blocks are released tail first, so a
prefix loses its end before its head (a prefix is useful only from its first block on).

With a host tier (tiered caching, :class:`HostPrefixTier`), an evicted block is first copied into
the host pool, so a returning long conversation copies its prefix back over the host link
instead of recomputing it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Optional


def block_hash(previous: Optional[int], token_ids: tuple[int, ...]) -> int:
    return hash((previous, token_ids))


@dataclass(frozen=True)
class CachedBlock:
    name: int
    block_id: int  # a device block, or a host block on the host tier
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class PrefixHit:
    name: int
    block_id: int  # a device block, or a host block when ``on_host``
    on_host: bool = False


def match_prefix(token_ids: list[int], block_size: int, cache: "PrefixCache",
                 host_lookup: Optional[Callable[[int, tuple[int, ...]], Optional[CachedBlock]]] = None,
                 first_block: int = 0, previous: Optional[int] = None) -> list[PrefixHit]:
    """The cached full blocks of ``token_ids`` from block ``first_block`` on (``previous`` names the block
    before it): each from the device tier, else from the host tier's ``host_lookup(name, tokens)``."""
    hits, name = [], previous
    for start in range(first_block * block_size, len(token_ids) - block_size + 1, block_size):
        tokens = tuple(token_ids[start:start + block_size])
        name = block_hash(name, tokens)
        entry = cache.lookup(name, tokens)
        if entry is not None:
            hits.append(PrefixHit(name, entry.block_id))
            continue
        entry = host_lookup(name, tokens) if host_lookup is not None else None
        if entry is None:
            break
        hits.append(PrefixHit(name, entry.block_id, on_host=True))
    return hits


class PrefixCache:
    """The device tier: named full blocks, with one reference each held by the cache."""

    def __init__(self, allocator):
        self.allocator = allocator
        self._by_name: dict[int, CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # block ids only the cache holds, oldest first

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._by_block

    def __iter__(self) -> Iterator[CachedBlock]:
        return iter(list(self._by_name.values()))

    @property
    def num_cached(self) -> int:
        return len(self._by_name)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def lookup(self, name: int, tokens: tuple[int, ...]) -> Optional[CachedBlock]:
        entry = self._by_name.get(name)
        return entry if entry is not None and entry.tokens == tokens else None

    def insert(self, name: int, tokens: tuple[int, ...], block_id: int) -> None:
        """Name a block a sequence has just filled (or copied back); the cache takes a reference."""
        if name in self._by_name or block_id in self._by_block:
            return
        entry = CachedBlock(name, block_id, tokens)
        self._by_name[name] = self._by_block[block_id] = entry
        self.allocator.fork(block_id)

    def acquired(self, block_id: int) -> None:
        """A sequence took a reference to a cached block: it is no longer evictable."""
        self._evictable.pop(block_id, None)

    def released(self, blocks: list[int]) -> None:
        """Sequences let go of ``blocks`` (in table order): those only the cache holds become evictable, tail first."""
        for block in reversed(blocks):
            if block in self._by_block and self.allocator.ref_count(block) == 1:
                self._evictable[block] = None

    def evict_one(self) -> Optional[CachedBlock]:
        """Forget the least recently released evictable block and free it; None if there is none."""
        if not self._evictable:
            return None
        block_id, _ = self._evictable.popitem(last=False)
        entry = self._by_block.pop(block_id)
        del self._by_name[entry.name]
        self.allocator.free(block_id)
        return entry


class HostPrefixTier:
    """Blocks evicted from the device cache, kept in the host pool, least recently used first out.

    Lab 10's reference: the grading sandbox stubs every method of this class, so each is its own (none
    inherited), though ``lookup`` and ``__iter__`` read as ``PrefixCache``'s do.
    """

    def __init__(self, host_allocator):
        self.allocator = host_allocator
        self._by_name: OrderedDict[int, CachedBlock] = OrderedDict()

    def __iter__(self) -> Iterator[CachedBlock]:
        return iter(list(self._by_name.values()))

    def __contains__(self, name: int) -> bool:
        return name in self._by_name

    @property
    def num_cached(self) -> int:
        return len(self._by_name)

    def lookup(self, name: int, tokens: tuple[int, ...]) -> Optional[CachedBlock]:
        entry = self._by_name.get(name)
        return entry if entry is not None and entry.tokens == tokens else None

    def put(self, name: int, tokens: tuple[int, ...], host_block: int) -> None:
        """Keep ``host_block`` (already allocated, its reference now the tier's) under ``name``."""
        self._by_name[name] = CachedBlock(name, host_block, tokens)

    def touch(self, name: int) -> None:
        self._by_name.move_to_end(name)

    def evict_one(self) -> bool:
        """Free the least recently used block that no move of this step reads or writes; False if none."""
        for name, entry in self._by_name.items():
            if self.allocator.ref_count(entry.block_id) == 1:  # more: a move of this step holds it
                del self._by_name[name]
                self.allocator.free(entry.block_id)
                return True
        return False
