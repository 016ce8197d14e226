"""Demotion: the prefix blocks a step evicts from the device, on their way to the host tier.

The device evicts a finished sequence's cached blocks tail first, so that a prefix loses its end
before its head, and one step may evict more of them than the host tier has room for. A prefix is
found only from its first block on, so the tier's room goes to the last blocks evicted (the heads)
first, and they join the tier tail first, so the tier too gives up a prefix's end before its head.
They join as the step ends, after the step's swaps have taken their host blocks, or the moment an
admission of the same step wants one (copied out and back in: the moves' phases order the two).
"""
from __future__ import annotations

from typing import Optional

from kvlib.core.prefix_cache import CachedBlock


class EvictedBlocks:
    """The blocks the prefix cache evicted this step, by name, in the order they went; kept on the host
    tier through the block manager's actions (``take_host``, ``hold_host``, ``release_host``)."""

    def __init__(self, block_manager):
        self.bm = block_manager
        self._blocks: dict[int, tuple[tuple[int, ...], int]] = {}  # name -> (tokens, device block)

    def add(self, entry: CachedBlock) -> None:
        """The first eviction of a name in a step is the one to copy: its block held it as the step began."""
        self._blocks.setdefault(entry.name, (entry.tokens, entry.block_id))

    def clear(self) -> None:
        self._blocks.clear()

    def lookup(self, name: int, tokens: tuple[int, ...]) -> Optional[CachedBlock]:
        """The host tier as an admission's lookup sees it mid-step: a block this step evicted is kept the
        moment a prompt wants it. While the step has evictions to keep, a hit is held, so making room for
        the next block of the prefix cannot drop it."""
        tier = self.bm.host_tier
        if name not in tier and self._blocks.get(name, (None,))[0] == tokens:
            host = self._host_block()
            if host is not None:
                self._put(name, host)
        entry = tier.lookup(name, tokens)
        if entry is not None and self._blocks:
            self.bm.hold_host(entry.block_id)
        return entry

    def keep(self) -> None:
        """Keep the rest on the host tier, as many as it has (or makes) room for: the last evicted first,
        and a block the tier keeps already held meanwhile, so that room is not made by dropping it."""
        tier, hosts = self.bm.host_tier, {}
        try:
            for name, (tokens, _) in reversed(self._blocks.items()):
                if name in tier:
                    kept = tier.lookup(name, tokens)
                    if kept is not None:
                        self.bm.hold_host(kept.block_id)
                    continue
                host = self._host_block()
                if host is None:
                    break
                hosts[name] = host
            for name in list(self._blocks):  # tail first
                if name in hosts:
                    self._put(name, hosts.pop(name))
                elif name in tier:
                    tier.touch(name)
        except BaseException:  # a plugged-in tier raised: the blocks not handed to it go back
            for host in hosts.values():
                self.bm.release_host(host)  # its own reference: the step's end lets go of its hold
            raise

    def _host_block(self) -> Optional[int]:
        """A held host block for the tier: a free one, or one the tier gives up; None if neither."""
        if self.bm.host_pool.num_free == 0 and not self.bm.host_tier.evict_one():
            return None
        return self.bm.hold_host(self.bm.take_host())

    def _put(self, name: int, host: int) -> None:
        """Hand ``host`` to the tier (its reference the tier's) and plan the copy of the evicted block into it.
        Should the tier raise, a block it kept anyway still gets its copy; one it did not keep goes back."""
        tokens, device_block = self._blocks[name]
        try:
            self.bm.host_tier.put(name, tokens, host)
        finally:
            if name in self.bm.host_tier:
                del self._blocks[name]
                self.bm.moves.demote.append((device_block, host))
            else:
                self.bm.release_host(host)
