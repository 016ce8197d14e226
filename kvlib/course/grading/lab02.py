"""Lab 02 checks: the learner's block allocator and block table, alone and inside the engine.

Each check targets one rule of the interface (``kvlib.interfaces.BlockAllocator``), so a bug
costs the checks that cover it and nothing else. The engine checks serve workloads with the
learner's allocator managing both pools: one that forks (parallel samples) and shares prefix
blocks, so a block freed while still shared is caught; one small enough to force swapping and
recomputation. Tokens are compared with kvlib's own allocator on the same workload.
"""
from __future__ import annotations

import random
from collections import Counter
from functools import cache

from kvlib.block_allocator import AllocStatus, BlockAllocator, BlockAllocatorError
from kvlib.course.grading.checks import Task, expect, expect_raises
from kvlib.course.grading.extract import Rules
from kvlib.course.grading.results import TaskResult
from kvlib.course.grading.serving import serve_checked

ALLOCATOR_RULES = Rules(needs=("MyBlockAllocator",),
                        kvlib_imports={"kvlib.block_allocator": {"AllocStatus", "BlockAllocatorError"}},
                        own_methods=("ref_count", "can_allocate", "allocate", "fork", "free"))
allocator = Task("allocator", ALLOCATOR_RULES)
block_table = Task("block_table", Rules(needs=("MyBlockTable",),
                                        own_methods=("num_missing_blocks", "slot", "slots", "pop_tail")))
engine = Task("engine", ALLOCATOR_RULES)
TASKS = [allocator, block_table, engine]


def check_allocator(allocator_cls) -> TaskResult:
    return allocator.grade(allocator_cls)


def check_block_table(block_table_cls) -> TaskResult:
    return block_table.grade(block_table_cls)


def check_engine(allocator_cls) -> TaskResult:
    return engine.grade(allocator_cls)


# ---- allocator ---------------------------------------------------------------------------------
@allocator.check(2, "allocate() takes an id off the free list, sets its reference count to 1, "
                    "and raises BlockAllocatorError when no block is free")
def allocate_unique(cls) -> None:
    pool = cls(16)
    expect((pool.num_blocks, pool.num_free, pool.num_used) == (16, 16, 0),
           f"a new allocator of 16 blocks reports num_blocks={pool.num_blocks}, num_free={pool.num_free}, "
           f"num_used={pool.num_used}; expected 16, 16, 0")
    ids = [pool.allocate() for _ in range(16)]
    expect(sorted(ids) == list(range(16)),
           f"allocating 16 blocks from a pool of 16 gave ids {ids}; expected each of 0..15 exactly once")
    expect(all(pool.ref_count(b) == 1 for b in ids), "a newly allocated block must have ref_count 1")
    expect((pool.num_free, pool.num_used) == (0, 16),
           f"with every block allocated, num_free={pool.num_free} and num_used={pool.num_used}; expected 0 and 16")
    expect_raises(BlockAllocatorError, pool.allocate, "allocate() on a pool with no free block")


@allocator.check(2, "free() drops one owner; when the count reaches 0 the block goes back on the free list")
def free_returns_block(cls) -> None:
    pool = cls(4)
    ids = [pool.allocate() for _ in range(4)]
    pool.free(ids[1])
    expect((pool.num_free, pool.num_used) == (1, 3),
           f"after freeing 1 block of a full pool of 4, num_free={pool.num_free} and num_used={pool.num_used}; "
           f"expected 1 and 3")
    expect(pool.ref_count(ids[1]) == 0, f"after free({ids[1]}), ref_count({ids[1]}) is {pool.ref_count(ids[1])}; expected 0")
    again = pool.allocate()
    expect(again == ids[1], f"block {ids[1]} was the only free block, but allocate() returned {again}")
    for block in ids:
        pool.free(block)
    expect(pool.num_free == 4, f"after freeing every block, num_free is {pool.num_free}; expected 4")


@allocator.check(2, "fork() adds an owner and returns the same id; free() removes one; "
                    "a block is free only once its last owner frees it")
def refcount(cls) -> None:
    pool = cls(4)
    block = pool.allocate()
    shared = pool.fork(block)
    expect(shared == block, f"fork({block}) returned {shared}; sharing a block must return the same id")
    pool.fork(block)
    expect(pool.ref_count(block) == 3, f"after allocate and 2 forks, ref_count is {pool.ref_count(block)}; expected 3")
    expect(pool.num_used == 1, f"forking shares a block, so num_used should stay 1, got {pool.num_used}")
    pool.free(block)
    expect((pool.ref_count(block), pool.num_free) == (2, 3),
           f"after 2 forks and 1 free, ref_count={pool.ref_count(block)} and num_free={pool.num_free}; "
           f"expected 2 and 3 (two owners still hold the block)")
    pool.free(block)
    pool.free(block)
    expect((pool.ref_count(block), pool.num_free) == (0, 4),
           f"after the last owner frees it, ref_count={pool.ref_count(block)} and num_free={pool.num_free}; "
           f"expected 0 and 4")


@allocator.check(1, "free() and fork() of a block nobody owns, or of an id outside 0..num_blocks-1, "
                    "must raise BlockAllocatorError and leave the pool unchanged")
def double_free_raises(cls) -> None:
    pool = cls(4)
    block = pool.allocate()
    pool.free(block)
    expect_raises(BlockAllocatorError, lambda: pool.free(block), f"freeing block {block} twice")
    expect_raises(BlockAllocatorError, lambda: pool.fork(block), f"forking free block {block}")
    never = next(b for b in range(4) if b != block)
    expect_raises(BlockAllocatorError, lambda: pool.free(never), f"freeing block {never}, never allocated")
    expect_raises(BlockAllocatorError, lambda: pool.free(4), "freeing block 4 in a pool of 4 (ids 0..3)")
    expect(pool.num_free == 4, f"a refused free must not change the pool, but num_free is now {pool.num_free}; expected 4")


@allocator.check(2, "can_allocate(n, watermark_blocks): NEVER when n > num_blocks - watermark_blocks, "
                    "OK when num_free - n >= watermark_blocks, otherwise LATER")
def watermark(cls) -> None:
    pool = cls(10)
    cases = [(10, 0, AllocStatus.OK), (11, 0, AllocStatus.NEVER), (8, 2, AllocStatus.OK), (9, 2, AllocStatus.NEVER)]
    _expect_answers(pool, cases)
    for _ in range(5):
        pool.allocate()
    cases = [(5, 0, AllocStatus.OK), (6, 0, AllocStatus.LATER), (3, 2, AllocStatus.OK), (4, 2, AllocStatus.LATER),
             (8, 2, AllocStatus.LATER), (9, 2, AllocStatus.NEVER)]
    _expect_answers(pool, cases)


def _expect_answers(pool, cases) -> None:
    for num_blocks, watermark_blocks, expected in cases:
        got = pool.can_allocate(num_blocks, watermark_blocks)
        expect(got == expected, f"with {pool.num_free} of {pool.num_blocks} blocks free, "
                                f"can_allocate({num_blocks}, watermark_blocks={watermark_blocks}) returned {got}; "
                                f"expected {expected}")


@allocator.check(1, "after every allocate, fork and free: each block's ref_count equals its owners, "
                    "num_free counts the blocks nobody owns, and num_free + num_used == num_blocks")
def random_workload(cls) -> None:
    for seed in range(5):
        rng = random.Random(seed)
        num_blocks = rng.randint(1, 24)
        pool, owners = cls(num_blocks), Counter()
        for step in range(200):
            owned = sorted(b for b, n in owners.items() if n)
            op = rng.choice(["allocate", "allocate", "fork", "free", "free"])
            if op == "allocate" and len(owned) < num_blocks:
                block = pool.allocate()
                expect(0 <= block < num_blocks and owners[block] == 0,
                       f"workload {seed}, step {step}: allocate() returned block {block}, which is "
                       f"{'still owned' if 0 <= block < num_blocks else 'outside 0..' + str(num_blocks - 1)}")
                owners[block] = 1
            elif op in ("fork", "free") and owned:
                block = rng.choice(owned)
                getattr(pool, op)(block)
                owners[block] += 1 if op == "fork" else -1
            else:
                continue
            _expect_consistent(pool, owners, f"workload {seed}, after {op} at step {step}")
        for block in list(owners.elements()):
            pool.free(block)
        expect(pool.num_free == num_blocks,
               f"workload {seed}: after every owner freed its blocks, num_free is {pool.num_free}; expected {num_blocks}")


def _expect_consistent(pool, owners: Counter, where: str) -> None:
    for block in range(pool.num_blocks):
        expect(pool.ref_count(block) == owners[block],
               f"{where}: ref_count({block}) is {pool.ref_count(block)} but {owners[block]} owner(s) hold it")
    unowned = sum(1 for block in range(pool.num_blocks) if owners[block] == 0)
    expect(pool.num_free == unowned, f"{where}: num_free is {pool.num_free} but {unowned} block(s) have no owner")
    expect(pool.num_free + pool.num_used == pool.num_blocks,
           f"{where}: num_free {pool.num_free} + num_used {pool.num_used} != num_blocks {pool.num_blocks}")


# ---- block table -------------------------------------------------------------------------------
@block_table.check(2, "token i sits in block blocks[i // block_size] at offset i % block_size; "
                      "its slot is that block id * block_size + offset")
def slot_mapping(cls) -> None:
    table = cls(4)
    for block in (7, 2, 9):
        table.append(block)
    expect(table.blocks == [7, 2, 9], f"after appending 7, 2, 9, blocks is {table.blocks}; expected [7, 2, 9]")
    for position, slot in {0: 28, 3: 31, 4: 8, 5: 9, 11: 39}.items():
        got = table.slot(position)
        expect(got == slot, f"with blocks [7, 2, 9] and block_size 4, slot({position}) is {got}; expected {slot} "
                            f"(block {table.blocks[position // 4]} * 4 + offset {position % 4})")
    got = table.slots(2, 7)
    expect(got == [30, 31, 8, 9, 10], f"slots(2, 7) is {got}; expected [30, 31, 8, 9, 10] (positions 2..6)")


@block_table.check(2, "capacity is len(blocks) * block_size; num_missing_blocks(n) is ceil(n / block_size) "
                      "minus the blocks already held, and never below 0")
def missing_blocks(cls) -> None:
    table = cls(4)
    expect(table.capacity == 0, f"an empty table has capacity {table.capacity}; expected 0")
    for tokens, missing in {0: 0, 1: 1, 4: 1, 5: 2, 12: 3}.items():
        got = table.num_missing_blocks(tokens)
        expect(got == missing, f"an empty table with block_size 4 needs {missing} block(s) for {tokens} tokens, "
                               f"num_missing_blocks gave {got}")
    table.append(3)
    table.append(0)
    expect(table.capacity == 8, f"2 blocks of 4 tokens hold 8 tokens, capacity is {table.capacity}")
    for tokens, missing in {3: 0, 8: 0, 9: 1, 17: 3}.items():
        got = table.num_missing_blocks(tokens)
        expect(got == missing, f"a table holding 2 blocks of 4 tokens needs {missing} more block(s) for {tokens} "
                               f"tokens, num_missing_blocks gave {got}")


@block_table.check(1, "pop_tail(count) removes and returns the last count blocks in table order; "
                      "pop_tail(0) removes nothing (blocks[-0:] is the whole list)")
def pop_tail(cls) -> None:
    table = cls(2)
    for block in (5, 3, 8, 1):
        table.append(block)
    got = table.pop_tail(2)
    expect((got, table.blocks) == ([8, 1], [5, 3]),
           f"from blocks [5, 3, 8, 1], pop_tail(2) returned {got} and left {table.blocks}; expected [8, 1] and [5, 3]")
    got = table.pop_tail(0)
    expect((got, table.blocks) == ([], [5, 3]),
           f"pop_tail(0) returned {got} and left {table.blocks}; expected [] and [5, 3]")
    got = table.pop_tail(2)
    expect((got, table.blocks) == ([5, 3], []), f"pop_tail(2) returned {got} and left {table.blocks}; expected [5, 3] and []")


# ---- engine ------------------------------------------------------------------------------------
# Six prompts that need up to 27 blocks in a pool of 12: the engine must swap and recompute.
PRESSURE = dict(block_size=4, num_gpu_blocks=12, num_cpu_blocks=6, preemption_mode="swap", device="cpu")
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(5 + i)] for i in range(6)]
# Three samples of each of four prompts that share a 12-token system prompt through prefix
# caching: blocks held by several sequences and the cache at once, freed one owner at a time.
SHARING = dict(block_size=4, num_gpu_blocks=40, num_cpu_blocks=8, preemption_mode="swap", watermark=0.0,
               enable_prefix_caching=True, device="cpu")
SYSTEM = [(11 * j) % 250 + 3 for j in range(12)]
SHARED_PROMPTS = [SYSTEM + [(5 * i + j) % 250 + 3 for j in range(2 + i)] for i in range(4)]
MAX_TOKENS = 10
MAX_STEPS = 500


@engine.check(3, "pass the allocator checks first; parallel samples fork their prompt's blocks and prefix "
                 "caching holds blocks too: free() must drop one owner, never the block while others hold it")
def shares_blocks(cls) -> None:
    _expect_same(cls, SHARING, SHARED_PROMPTS, n=3)


@engine.check(2, "under memory pressure the engine swaps and recomputes; it needs exact free counts, and every "
                 "block must be free again once all requests finish")
def serves_under_pressure(cls) -> None:
    _expect_same(cls, PRESSURE, PROMPTS, n=1)


def _expect_same(cls, config: dict, prompts: list, n: int) -> None:
    tokens, pools, cached = _serve(cls, tuple(config.items()), tuple(map(tuple, prompts)), n)
    for i, (mine, reference) in enumerate(zip(tokens, _reference_tokens(tuple(config.items()),
                                                                         tuple(map(tuple, prompts)), n))):
        expect(mine == reference, f"request {i} generated {mine} with your allocator but {reference} with kvlib's; "
                                  f"a block was reused while a sequence still held it")
    for name, pool in zip(("device", "host"), pools):
        owned = [b for b in range(pool.num_blocks) if pool.ref_count(b)]
        expected = cached if name == "device" else 0
        expect(len(owned) == expected and pool.num_free == pool.num_blocks - expected,
               f"after every request finished, the {name} pool has {pool.num_free} of {pool.num_blocks} blocks free "
               f"and {len(owned)} still owned; expected {expected} owned (the prefix cache's own)")


@cache
def _reference_tokens(config: tuple, prompts: tuple, n: int) -> tuple:
    return tuple(_serve(BlockAllocator, config, prompts, n)[0])


def _serve(make_allocator, config: tuple, prompts: tuple, n: int) -> tuple[list, list, int]:
    """Serve ``prompts`` step by step with ``make_allocator`` for both pools, checking bookkeeping after each step."""
    from kvlib import LLM, EngineConfig, SamplingParams

    pools = []

    def tracked(num_blocks: int):
        pools.append(make_allocator(num_blocks))
        return pools[-1]

    llm = LLM("default", EngineConfig(**dict(config)), allocator=tracked, verbose=False)
    outputs = serve_checked(llm, [list(p) for p in prompts], SamplingParams(max_tokens=MAX_TOKENS, n=n), MAX_STEPS)
    rejected = [f"request {i}: {out.error}" for i, out in enumerate(outputs) if out.error]
    expect(not rejected, f"the engine rejected requests: {'; '.join(rejected)}")
    cache = llm.engine.block_manager.cache
    return [[s.token_ids for s in out.samples] for out in outputs], pools, cache.num_cached if cache else 0
