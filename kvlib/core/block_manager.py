"""The block manager: which KV blocks each sequence holds, on the device and in the host pool.

It is the mechanism under the scheduler's policy. The scheduler asks predicate/action pairs
(``can_admit``/``admit``, ``shortfall``/``grow``, ``can_swap_in``/``swap_in``, ``swap_out``,
``drop``, ``fork``) and never touches a reference count; the block manager owns both pools' allocators
(``device_pool``, ``host_pool``), the prefix cache with its host tier, and block sharing. It moves no bytes either:
each action adds the copies it implies to the step's :class:`~kvlib.core.plan.BlockMoves`, which the model runner
carries out before the forward pass.

Three rules keep a step's copies correct whatever order the actions came in:

- Moves run in three phases: device to host (swap-out, demotion), device to device
  (copy-on-write), host to device (swap-in, promotion); every copy reads what its source held
  when the step began. A device block that a swap-out frees can therefore be reused at once.
- A host block that a move of this step reads or writes is held (one extra reference) until the
  step's moves are done, so no other action of the same step can reuse it.
- A full block never changes while anyone holds it, so one host copy of it serves every sample
  that swaps it out, and one device copy every sample that swaps it back in (its *twin*).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from kvlib.core.block_allocator import AllocStatus
from kvlib.core.block_table import blocks_for
from kvlib.core.demotion import EvictedBlocks
from kvlib.core.plan import BlockMoves
from kvlib.core.prefix_cache import HostPrefixTier, PrefixCache, PrefixHit, block_hash, match_prefix
from kvlib.core.sequence import Sequence
from kvlib.core.sharing import BlockSharing


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens of sequences looked up in the prefix cache
    hit_tokens: int = 0  # of those, tokens served from cached blocks
    host_hit_tokens: int = 0  # of the hits, tokens copied back from the host tier


class BlockManager:
    """Subclasses may replace the preemption mechanisms (``swap_out``, ``swap_in``, ``drop`` and
    ``host_blocks_needed``, see ``kvlib.interfaces.PreemptionMechanism``) with the block actions,
    each with one meaning: ``take`` / ``take_host`` (a new block, one reference), ``share`` (one more
    reference to a device block), ``release`` (a sequence lets go of its last device blocks),
    ``release_host`` (one reference to a host block goes), and ``copy_out`` / ``copy_in`` (plan a
    copy between the pools for this step)."""

    def __init__(self, block_size: int, device_allocator, host_allocator, *, watermark_blocks: int = 0,
                 enable_prefix_caching: bool = False, host_prefix_cache: bool = False,
                 sharing: Optional[BlockSharing] = None, host_tier_factory: Callable = HostPrefixTier):
        self.block_size = block_size
        self.device_pool = device_allocator
        self.host_pool = host_allocator
        self.watermark_blocks = watermark_blocks
        self.sharing = sharing or BlockSharing()
        self.cache = PrefixCache(device_allocator) if enable_prefix_caching else None
        self.host_tier = host_tier_factory(host_allocator) if host_prefix_cache else None
        self.prefix_stats = PrefixStats()
        self.moves = BlockMoves()
        self._held_host: list[int] = []  # host blocks read or written by this step's moves
        self.evicted = EvictedBlocks(self)  # prefix blocks this step evicted, on their way to the host tier
        self._moved_out: dict[int, int] = {}  # device -> host copy made this step
        self._host_twin: dict[int, int] = {}  # full device block -> host block with the same K/V
        self._device_twin: dict[int, int] = {}  # full host block -> device block with the same K/V

    # ---- the step ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.moves = BlockMoves()
        self._moved_out.clear()
        self.evicted.clear()

    def end_step(self) -> BlockMoves:
        """The step's moves, the step's evicted prefix blocks kept on the host tier first; the host blocks the
        moves hold are let go (the copies run before anything reuses them), even if a plugged-in tier raised."""
        try:
            if self.host_tier is not None:
                self.evicted.keep()
        finally:
            for block in self._held_host:
                self.release_host(block)
            self._held_host.clear()
            self.evicted.clear()
        return self.moves

    # ---- capacity ------------------------------------------------------------------------------
    @property
    def num_device_blocks(self) -> int:
        return self.device_pool.num_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free

    @property
    def num_host_blocks_for_swap(self) -> int:
        """Host blocks a swap can have now: free ones, and host-tier prefix blocks no move of this step holds,
        which ``make_host_room`` evicts for it."""
        tier = self.host_tier or ()
        return self.host_pool.num_free + sum(1 for entry in tier if self.host_pool.ref_count(entry.block_id) == 1)

    @property
    def num_free_blocks(self) -> int:
        """Device blocks that can be handed out now: free ones, plus cached ones nobody uses."""
        return self.device_pool.num_free + (self.cache.num_evictable if self.cache is not None else 0)

    def _status(self, needed: int, use_watermark: bool, revived: int = 0) -> AllocStatus:
        """The allocator's answer, counting evictable cached blocks (minus those a hit revives) as free: those
        left over once ``needed`` is met count towards the watermark too."""
        spare = self.cache.num_evictable - revived if self.cache is not None else 0
        watermark = self.watermark_blocks if use_watermark else 0
        if needed >= spare:
            return self.device_pool.can_allocate(needed - spare, watermark)
        return self.device_pool.can_allocate(0, max(0, watermark - (spare - needed)))

    def sharers(self, block: int) -> int:
        """Sequences holding a device block (the prefix cache's own reference is not a user)."""
        return self.device_pool.ref_count(block) - (1 if self.cache is not None and block in self.cache else 0)

    def unique_tail(self, seq: Sequence) -> int:
        """Trailing device blocks no other sequence holds: what a partial preemption can take."""
        count = 0
        for block in reversed(seq.block_table.blocks):
            if self.sharers(block) != 1:
                break
            count += 1
        return count

    def num_shared(self, seq: Sequence) -> int:
        return sum(1 for block in seq.block_table.blocks if self.sharers(block) > 1)

    # ---- growing -------------------------------------------------------------------------------
    def blocks_to_grow(self, seq: Sequence, end: int) -> int:
        """New device blocks ``seq`` needs to compute up to position ``end``: missing ones and private copies.

        Asked for every running sequence in every step, so it counts in one pass, building nothing."""
        blocks, ref_count = seq.block_table.blocks, self.device_pool.ref_count
        shared = sum(ref_count(blocks[i]) > 1 for i in self._written(seq, end))
        return seq.block_table.num_missing_blocks(end) + shared

    def shortfall(self, seq: Sequence, end: int) -> int:
        """Device blocks missing for ``seq`` to grow to ``end``: 0 when it can (a decode inside its last block
        needs none), else what preemption must free. One count answers both questions, so they cannot disagree."""
        return max(0, self.blocks_to_grow(seq, end) - self.num_free_blocks)

    def grow(self, seq: Sequence, end: int) -> None:
        """Make room for positions ``num_computed_tokens .. end-1``: a private copy of any shared block they write."""
        blocks, ref_count = seq.block_table.blocks, self.device_pool.ref_count
        for index in self._written(seq, end):
            if ref_count(blocks[index]) > 1:
                copy = self.sharing.make_writable(self.device_pool, blocks, index, self.take)
                if copy is not None:
                    self.moves.copies.append(copy)
        for _ in range(seq.block_table.num_missing_blocks(end)):
            seq.block_table.append(self.take())

    def _written(self, seq: Sequence, end: int) -> range:
        """Indices of the blocks ``seq`` already holds that positions ``num_computed_tokens .. end-1`` write."""
        return range(seq.num_computed_tokens // self.block_size,
                     min(len(seq.block_table.blocks), blocks_for(end, self.block_size)))

    # ---- admission -----------------------------------------------------------------------------
    def prefix_hits(self, seq: Sequence) -> list[PrefixHit]:
        """Cached blocks for a waiting sequence, from its first missing block on: all of them for a new one,
        the tail a partial preemption let go for one that kept its head. Its last token is always computed."""
        held = len(seq.block_table)
        if (self.cache is None or seq.host_blocks or len(seq.block_hashes) != held
                or seq.num_computed_tokens != held * self.block_size):
            return []
        host_lookup = self.evicted.lookup if self.host_tier is not None else None
        previous = seq.block_hashes[-1] if held else None
        return match_prefix(seq.token_ids[:-1], self.block_size, self.cache, host_lookup, held, previous)

    def cached_prefix(self, token_ids: list[int]) -> list[PrefixHit]:
        """The leading full blocks of ``token_ids`` the prefix cache (or its host tier) holds now."""
        if self.cache is None:
            return []
        host_lookup = self.host_tier.lookup if self.host_tier is not None else None
        return match_prefix(token_ids, self.block_size, self.cache, host_lookup)

    def can_admit(self, seq: Sequence, hits: list[PrefixHit], end: int, use_watermark: bool) -> bool:
        if not hits:
            return self._status(self.blocks_to_grow(seq, end), use_watermark) is AllocStatus.OK
        from_host = sum(1 for h in hits if h.on_host)  # each is copied back into a new device block
        revived = sum(1 for h in hits if not h.on_host and self.device_pool.ref_count(h.block_id) == 1)
        needed = from_host + max(0, blocks_for(end, self.block_size) - len(seq.block_table) - len(hits))
        return self._status(needed, use_watermark, revived) is AllocStatus.OK

    def admit(self, seq: Sequence, hits: list[PrefixHit]) -> None:
        """Take the hit blocks, copying host-tier ones back; ``grow`` makes room for the rest. Should a
        plugged-in tier raise, the sequence gives back what it took and waits as it came."""
        held = len(seq.block_table)
        # Claim every hit before taking a device block: taking one may evict a cached block that is
        # an unclaimed hit; a host hit is held, so the tier cannot drop it when the step's evictions join it.
        claimed = [self.hold_host(h.block_id) if h.on_host else self.share(h.block_id) for h in hits]
        for index, (hit, block) in enumerate(zip(hits, claimed)):
            if hit.on_host:
                try:  # the tier first: nothing of this hit is taken yet if it raises
                    entry = self.host_tier.lookup(hit.name, self._block_tokens(seq, len(seq.block_table)))
                    self.host_tier.touch(hit.name)
                except BaseException:
                    self._let_go([b for h, b in zip(hits[index:], claimed[index:]) if not h.on_host])
                    self.release(seq, len(seq.block_table) - held)
                    raise
                block = self.take()
                self.moves.promote.append((hit.block_id, block))  # the hold above keeps the host block
                self.cache.insert(hit.name, entry.tokens, block)
            seq.block_table.append(block)
            seq.block_hashes.append(hit.name)
        seq.num_computed_tokens += len(hits) * self.block_size
        if self.cache is not None and held == 0:  # a new prompt's lookup, not a resumed sequence's
            self._record_query(seq, hits)

    def _record_query(self, seq: Sequence, hits: list[PrefixHit]) -> None:
        self.prefix_stats.queried_tokens += seq.num_tokens
        self.prefix_stats.hit_tokens += len(hits) * self.block_size
        self.prefix_stats.host_hit_tokens += sum(self.block_size for h in hits if h.on_host)

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])

    # ---- swapping ------------------------------------------------------------------------------
    def host_blocks_needed(self, seqs: list[Sequence], count: Optional[int] = None) -> int:
        """Host blocks a swap-out of each sequence's last ``count`` blocks (None: all) would allocate."""
        new = set()
        for seq in seqs:
            for index, block in self._tail(seq, count):
                if block not in self._moved_out and not (self._is_full(seq, index) and block in self._host_twin):
                    new.add(block)
        return len(new)

    def make_host_room(self, needed: int) -> bool:
        """Evict host-tier prefix blocks until ``needed`` host blocks are free: a preempted sequence outranks them."""
        while self.host_pool.num_free < needed and self.host_tier is not None and self.host_tier.evict_one():
            pass
        return self.host_pool.num_free >= needed

    def swap_out(self, seq: Sequence, count: Optional[int] = None) -> None:
        """Move the last ``count`` device blocks (None: all) to the host; the caller made room."""
        hosts = []
        for index, block in self._tail(seq, count):
            if block in self._moved_out:
                host = self.host_pool.fork(self._moved_out[block])
            elif self._is_full(seq, index) and block in self._host_twin:
                host = self.host_pool.fork(self._host_twin[block])
            else:
                host = self.take_host()
                self.copy_out(block, host)
                self._moved_out[block] = host
                if self._is_full(seq, index):
                    self._pair(block, host)
            hosts.append(host)
        seq.host_blocks = hosts + seq.host_blocks
        self.release(seq, len(hosts))

    def can_swap_in(self, seq: Sequence, end: int, use_watermark: bool) -> bool:
        needed = blocks_for(end, self.block_size) - len(seq.block_table)  # at most one new block per position past the head
        return self._status(needed, use_watermark) is AllocStatus.OK

    def swap_in(self, seq: Sequence) -> None:
        """Bring ``seq``'s host blocks back to the device, sharing a full block's twin instead of copying it.

        A partly filled block is copied for each sample, never shared: its next write would otherwise
        need a copy-on-write of a block whose K/V only arrives in this step's last phase.
        """
        for host in seq.host_blocks:
            index = len(seq.block_table)
            if self._is_full(seq, index) and host in self._device_twin:
                block = self.share(self._device_twin[host])
            else:
                block = self.take()
                self.copy_in(host, block)  # holds the host block until the copy has run
                if self._is_full(seq, index):
                    self._pair(block, host)
            seq.block_table.append(block)
            self.release_host(host)
        seq.host_blocks = []

    def _tail(self, seq: Sequence, count: Optional[int]) -> list[tuple[int, int]]:
        """(table index, block) of the last ``count`` device blocks (None: all)."""
        blocks = seq.block_table.blocks
        first = 0 if count is None else len(blocks) - count
        return list(enumerate(blocks))[first:]

    def _is_full(self, seq: Sequence, index: int) -> bool:
        return (index + 1) * self.block_size <= seq.num_computed_tokens

    def _pair(self, device_block: int, host_block: int) -> None:
        self._host_twin[device_block] = host_block
        self._device_twin[host_block] = device_block

    # ---- letting go ----------------------------------------------------------------------------
    def drop(self, seq: Sequence, count: Optional[int] = None) -> int:
        """Recompute later: let go of the last ``count`` device blocks (None: all) and of any host copy.

        Host blocks hold positions after the device ones, so they go too. Returns the computed
        tokens lost.
        """
        before = seq.num_computed_tokens
        for host in seq.host_blocks:
            self.release_host(host)
        seq.host_blocks = []
        self.release(seq, len(seq.block_table) if count is None else count)
        return before - seq.num_computed_tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` continues from ``parent``'s computed tokens, sharing every block by reference."""
        child.block_table.blocks = self.sharing.fork(self.device_pool, list(parent.block_table.blocks))
        child.num_computed_tokens = child.peak_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)

    def register_computed(self, seq: Sequence) -> None:
        """Name the blocks ``seq`` has just filled, so later requests can reuse them."""
        if self.cache is None:
            return
        for index in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            previous = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = self._block_tokens(seq, index)
            name = block_hash(previous, tokens)
            self.cache.insert(name, tokens, seq.block_table.blocks[index])
            seq.block_hashes.append(name)

    def release(self, seq: Sequence, count: int) -> None:
        """Drop ``seq``'s reference to its last ``count`` device blocks; shared ones live on for the others.

        Its computed tokens shrink to what its remaining blocks, on the device and the host, hold.
        """
        self._let_go(seq.block_table.pop_tail(count))
        kept = (len(seq.block_table) + len(seq.host_blocks)) * self.block_size
        seq.num_computed_tokens = min(seq.num_computed_tokens, kept)
        del seq.block_hashes[len(seq.block_table) + len(seq.host_blocks):]

    def _let_go(self, blocks: list[int]) -> None:
        """One reference to each of ``blocks`` (in table order) goes; cached ones nobody holds become evictable."""
        for block in blocks:
            self.device_pool.free(block)
            self._forget_if_free(block)
        if self.cache is not None:
            self.cache.released(blocks)

    # ---- single blocks -------------------------------------------------------------------------
    def take(self) -> int:
        """A free device block, evicting the least recently released cached one when none is free."""
        if self.device_pool.num_free == 0 and self.cache is not None:
            entry = self.cache.evict_one()
            if entry is not None:
                self._forget_if_free(entry.block_id)
                if self.host_tier is not None:
                    self.evicted.add(entry)
        return self.device_pool.allocate()

    def share(self, block: int) -> int:
        """One more owner for a device block (a cached block nobody used is no longer evictable)."""
        if self.cache is not None:
            self.cache.acquired(block)
        return self.device_pool.fork(block)

    def copy_out(self, device_block: int, host_block: int) -> None:
        """Plan this step's copy of a device block's K/V into a host block (the first of the step's phases).

        The host block is held until the copy has run, so no later action of the step can reuse it."""
        self.moves.swap_out.append((device_block, self.hold_host(host_block)))

    def copy_in(self, host_block: int, device_block: int) -> None:
        """Plan this step's copy of a host block's K/V into a device block (the step's last phase).

        The host block is held until the copy has read it, so its owner may release it at once."""
        self.moves.swap_in.append((self.hold_host(host_block), device_block))

    def hold_host(self, block: int) -> int:
        """One more reference to a host block, let go when the step's moves are done: nothing reuses it before."""
        self._held_host.append(self.host_pool.fork(block))
        return block

    def take_host(self) -> int:
        """A free host block, with one reference: the caller's."""
        return self.host_pool.allocate()

    def release_host(self, block: int) -> None:
        """One reference to a host block goes (a copy planned this step still holds its own)."""
        self.host_pool.free(block)
        if self.host_pool.ref_count(block) == 0 and block in self._device_twin:
            self._host_twin.pop(self._device_twin.pop(block), None)

    def _forget_if_free(self, block: int) -> None:
        if self.device_pool.ref_count(block) == 0 and block in self._host_twin:
            self._device_twin.pop(self._host_twin.pop(block), None)
