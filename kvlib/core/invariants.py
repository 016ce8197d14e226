"""Block bookkeeping invariants, checked after any engine step (tests and graders, with :func:`serve_checked`,
after every one).

For both pools: every block is free or owned, each block's reference count equals the number of
sequences whose table holds it (plus one for the prefix cache or its host tier, if it names the
block), and free plus used equals the pool.
"""
from __future__ import annotations

import itertools
from collections import Counter


class InvariantError(AssertionError):
    pass


class StalledError(InvariantError):
    """Requests were still unfinished after the steps allowed: a plugged piece's bug can stall the engine."""


_ids = itertools.count()  # request ids unique across calls on one engine


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


def serve_checked(llm, prompts: list, params, max_steps: int) -> list:
    """Serve ``prompts`` on ``llm`` (one SamplingParams for all, or one each) and return their outputs in order.

    Raises :class:`InvariantError`, naming the step, as soon as a rule breaks, and :class:`StalledError`
    if requests are still unfinished after ``max_steps`` steps.
    """
    per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    ids = [f"checked-{next(_ids)}" for _ in prompts]
    for request_id, prompt, p in zip(ids, prompts, per_prompt):
        llm.engine.add_request(request_id, prompt, p)
    finished = {}
    for step in range(max_steps):
        if not llm.engine.has_unfinished_requests():
            break
        finished.update((out.request_id, out) for out in llm.engine.step() if out.finished)
        try:
            check_invariants(llm.engine)
        except InvariantError as exc:
            raise InvariantError(f"after engine step {step + 1}: {exc}") from exc
    else:
        raise StalledError(f"requests were still unfinished after {max_steps} engine steps")
    return [finished[request_id] for request_id in ids]
