"""Block bookkeeping invariants, checked after any engine step (tests call this after every one).

For both pools: every block is free or owned, each block's reference count equals the number of
sequences whose table holds it (plus one for the prefix cache, if it names the block), and free
plus used equals the pool.
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
    s = engine.scheduler
    live = s.waiting + s.running + s.swapped
    device_owners = Counter(b for seq in live for b in seq.block_table.blocks)
    host_owners = Counter(b for seq in live for b in seq.host_blocks)
    if s.cache is not None:  # the prefix cache holds one reference to each block it names
        device_owners.update(b for b in range(s.gpu.num_blocks) if b in s.cache)
        host_owners.update(s.cache.host_blocks())
    _check_pool("device", s.gpu, device_owners)
    _check_pool("host", s.cpu, host_owners)
    for seq in live:
        if seq.num_computed_tokens > seq.block_table.capacity + len(seq.host_blocks) * s.config.block_size:
            raise InvariantError(f"sequence {seq.seq_id} claims {seq.num_computed_tokens} computed tokens "
                                 f"but holds room for fewer")
