"""Block bookkeeping invariants, checked after any engine step (tests call this after every one).

For both pools: every block is free or owned, each block's reference count equals the number of
sequences whose table holds it (plus one for the prefix cache or its host tier, if it names the
block), and free plus used equals the pool.
"""
from __future__ import annotations

from collections import Counter


class InvariantError(AssertionError):
    pass


def _check_pool(name: str, allocator, owners: Counter) -> None:
    free = 0
    for block in range(allocator.num_blocks):
        refs = allocator.ref_count(block)
        if refs != owners.get(block, 0):
            raise InvariantError(f"{name} block {block}: reference count {refs} but {owners.get(block, 0)} owners")
        free += refs == 0
    if free != allocator.num_free:
        raise InvariantError(f"{name} pool: {free} blocks have no owner but the allocator reports {allocator.num_free} free")
    if allocator.num_free + allocator.num_used != allocator.num_blocks:
        raise InvariantError(f"{name} pool: free {allocator.num_free} + used {allocator.num_used} != {allocator.num_blocks}")


def check_invariants(engine) -> None:
    """Raise :class:`InvariantError` naming the first broken rule."""
    s, bm = engine.scheduler, engine.block_manager
    live = s.waiting + s.running + s.swapped
    device_owners = Counter(b for seq in live for b in seq.block_table.blocks)
    host_owners = Counter(b for seq in live for b in seq.host_blocks)
    if bm.cache is not None:
        device_owners.update(entry.block_id for entry in bm.cache)
    if bm.host_tier is not None:
        host_owners.update(entry.block_id for entry in bm.host_tier)
    _check_pool("device", bm.device_pool, device_owners)
    _check_pool("host", bm.host_pool, host_owners)
    for seq in live:
        if seq.num_computed_tokens > (len(seq.block_table) + len(seq.host_blocks)) * bm.block_size:
            raise InvariantError(f"sequence {seq.seq_id} claims {seq.num_computed_tokens} computed tokens "
                                 f"but holds room for fewer")
    running_slots = sum(seq.num_slots for seq in s.running)
    if running_slots > s.config.max_num_seqs:
        raise InvariantError(f"{running_slots} sequences run (or will, once they fork), more than "
                             f"max_num_seqs={s.config.max_num_seqs}")
