"""Lab 02 checks: the learner's block allocator and block table, alone and inside the engine.

Each check targets one rule of the interface (``kvlib.interfaces.BlockAllocator``) on sizes and
ids drawn from the seed, so a bug costs the checks that cover it and nothing else. Every check
observes what the piece does and is compared with kvlib's own allocator or table on the same
inputs. The engine checks serve workloads with the learner's allocator managing both pools: one
that forks (parallel samples) and shares prefix blocks, so a block freed while still shared is
caught; one small enough to force swapping and recomputation.
"""
from __future__ import annotations

import random
from collections import Counter

from kvlib import interfaces
from kvlib.core.block_allocator import AllocStatus, BlockAllocatorError
from kvlib.course.grading.checks import Task, raised
from kvlib.course.grading.decisions import calls_to
from kvlib.course.grading.hidden import kvlibs_own
from kvlib.course.grading.serving import random_tokens, serve_checked

ALLOCATOR = ("kvlib.core.block_allocator:BlockAllocator",)
TABLE = tuple(f"kvlib.core.block_table:BlockTable.{m}" for m in ("capacity", "num_missing_blocks", "slot", "slots",
                                                              "pop_tail"))


# The allocator's answers come back from the sandbox call by call, and the grader measures them in its own
# scenarios and engine runs: the bookkeeping checks run where the learner's code cannot reach (decisions.py).
ANSWERS = calls_to(interfaces.BlockAllocator, enums=(AllocStatus,), errors=(BlockAllocatorError,))
allocator = Task("allocator", ("MyBlockAllocator",), ALLOCATOR, kvlibs_own(ALLOCATOR[0]), decisions=ANSWERS)
block_table = Task("block_table", ("MyBlockTable",), TABLE, kvlibs_own("kvlib.core.block_table:BlockTable"))
engine = Task("engine", ("MyBlockAllocator",), ALLOCATOR, kvlibs_own(ALLOCATOR[0]), decisions=ANSWERS)
TASKS = [allocator, block_table, engine]
check_allocator, check_block_table, check_engine = allocator.grade, block_table.grade, engine.grade


# ---- allocator ---------------------------------------------------------------------------------
@allocator.check(2, "allocate() takes an id off the free list, sets its reference count to 1, "
                    "and raises BlockAllocatorError when no block is free")
def allocate_unique(cls, rng: random.Random) -> dict:
    n = rng.randint(6, 24)
    pool = cls(n)
    new = [pool.num_blocks, pool.num_free, pool.num_used]
    ids = [pool.allocate() for _ in range(n)]
    return {f"num_blocks, num_free, num_used of a new pool of {n}": new,
            f"the ids of {n} allocations from it, sorted": sorted(ids),
            "their ref_counts": [pool.ref_count(b) for b in sorted(ids)],
            "num_free, num_used with every block allocated": [pool.num_free, pool.num_used],
            "what allocate() on a full pool raises": raised(pool.allocate)}


@allocator.check(2, "free() drops one owner; when the count reaches 0 the block goes back on the free list")
def free_returns_block(cls, rng: random.Random) -> dict:
    n = rng.randint(3, 12)
    pool = cls(n)
    ids = [pool.allocate() for _ in range(n)]
    freed = ids[rng.randrange(n)]
    pool.free(freed)
    seen = {f"num_free, num_used after freeing 1 block of a full pool of {n}": [pool.num_free, pool.num_used],
            "ref_count of the freed block": pool.ref_count(freed),
            "allocate() then returns the freed block": pool.allocate() == freed}
    for block in ids:
        pool.free(block)
    seen["num_free after freeing every block"] = pool.num_free
    return seen


@allocator.check(2, "fork() adds an owner and returns the same id; free() removes one; "
                    "a block is free only once its last owner frees it")
def refcount(cls, rng: random.Random) -> dict:
    n, forks = rng.randint(2, 8), rng.randint(1, 4)
    pool = cls(n)
    block = pool.allocate()
    same_ids = all(pool.fork(block) == block for _ in range(forks))
    seen = {"fork returns the id it shares": same_ids,
            f"ref_count, num_used after allocate and {forks} forks": [pool.ref_count(block), pool.num_used]}
    counts = []
    for _ in range(forks + 1):
        pool.free(block)
        counts.append([pool.ref_count(block), pool.num_free])
    seen["ref_count, num_free after each free"] = counts
    return seen


@allocator.check(1, "free() and fork() of a block nobody owns, or of an id outside 0..num_blocks-1, "
                    "must raise BlockAllocatorError and leave the pool unchanged")
def double_free_raises(cls, rng: random.Random) -> dict:
    n = rng.randint(3, 10)
    pool = cls(n)
    block = pool.allocate()
    pool.free(block)
    never = next(b for b in range(n) if b != block)
    return {"freeing a block twice raises": raised(lambda: pool.free(block)),
            "forking a free block raises": raised(lambda: pool.fork(block)),
            "freeing a block never allocated raises": raised(lambda: pool.free(never)),
            f"freeing block {n} of a pool of {n} raises": raised(lambda: pool.free(n)),
            "forking block -1 raises": raised(lambda: pool.fork(-1)),
            "num_free after the refused calls": pool.num_free}


@allocator.check(2, "can_allocate(n, watermark_blocks): NEVER when n > num_blocks - watermark_blocks, "
                    "OK when num_free - n >= watermark_blocks, otherwise LATER")
def watermark(cls, rng: random.Random) -> dict:
    n = rng.randint(8, 16)
    pool = cls(n)
    answers = {}
    for used in (0, rng.randint(1, n - 1), n):
        while pool.num_used < used:
            pool.allocate()
        for want in sorted({0, 1, n - pool.num_used, n - pool.num_used + 1, n - 2, n - 1, n, n + 1}):
            for mark in (0, 1, 2):
                answers[f"{used} of {n} used, can_allocate({want}, watermark_blocks={mark})"] = \
                    str(pool.can_allocate(want, mark))
    return answers


@allocator.check(1, "after every allocate, fork and free: each block's ref_count equals its owners, "
                    "num_free counts the blocks nobody owns, and num_free + num_used == num_blocks")
def random_workload(cls, rng: random.Random) -> dict:
    runs = {}
    for run in range(5):
        num_blocks = rng.randint(1, 24)
        pool, blocks, owners, trace = cls(num_blocks), {}, Counter(), []  # blocks and owners by allocation number
        for _ in range(200):
            live = sorted(label for label, count in owners.items() if count)
            op = rng.choice(["allocate", "allocate", "fork", "free", "free"])
            if op == "allocate" and len(live) < num_blocks:
                block = pool.allocate()
                trace.append(0 <= block < num_blocks and block not in {blocks[label] for label in live})
                blocks[len(blocks)] = block
                owners[len(blocks) - 1] = 1
            elif op in ("fork", "free") and live:
                label = rng.choice(live)
                getattr(pool, op)(blocks[label])
                owners[label] += 1 if op == "fork" else -1
            else:
                continue
            live = sorted(label for label, count in owners.items() if count)
            trace.append([[pool.ref_count(blocks[label]) for label in live], pool.num_free, pool.num_used])
        for label in list(owners.elements()):
            pool.free(blocks[label])
        runs[f"workload {run}: after each call, a fresh id or not; the ref_count of each owned block, num_free, "
             f"num_used"] = trace
        runs[f"workload {run}: num_free once every owner freed"] = pool.num_free
    return runs


# ---- block table -------------------------------------------------------------------------------
def _blocks(rng: random.Random, count: int) -> list[int]:
    return rng.sample(range(40), count)


@block_table.check(2, "token i sits in block blocks[i // block_size] at offset i % block_size; "
                      "its slot is that block id * block_size + offset")
def slot_mapping(cls, rng: random.Random) -> dict:
    size = rng.choice([2, 3, 4, 8])
    table = cls(size)
    blocks = _blocks(rng, 3)
    for block in blocks:
        table.append(block)
    positions = sorted(rng.sample(range(3 * size), 5)) + [0, 3 * size - 1]
    start = rng.randrange(size)
    return {f"blocks after appending {blocks}": list(table.blocks),
            f"slot(p) for p in {positions}, block_size {size}": [table.slot(p) for p in positions],
            f"slots({start}, {start + size + 1})": table.slots(start, start + size + 1)}


@block_table.check(2, "capacity is len(blocks) * block_size; num_missing_blocks(n) is ceil(n / block_size) "
                      "minus the blocks already held, and never below 0")
def missing_blocks(cls, rng: random.Random) -> dict:
    size = rng.choice([2, 4, 5, 16])
    table = cls(size)
    tokens = [0, 1, size - 1, size, size + 1, 3 * size, 3 * size + 1]
    seen = {"capacity of an empty table": table.capacity,
            f"num_missing_blocks(n) of an empty table for n in {tokens}": [table.num_missing_blocks(t) for t in tokens]}
    for block in _blocks(rng, 2):
        table.append(block)
    seen["capacity with 2 blocks"] = table.capacity
    seen[f"num_missing_blocks(n) with 2 blocks for n in {tokens}"] = [table.num_missing_blocks(t) for t in tokens]
    return seen


@block_table.check(1, "pop_tail(count) removes and returns the last count blocks in table order; "
                      "pop_tail(0) removes nothing (blocks[-0:] is the whole list)")
def pop_tail(cls, rng: random.Random) -> dict:
    table = cls(2)
    blocks = _blocks(rng, 5)
    for block in blocks:
        table.append(block)
    seen = {}
    for count in (2, 0, 3):
        seen[f"pop_tail({count}), then blocks"] = [table.pop_tail(count), list(table.blocks)]
    return seen


# ---- engine ------------------------------------------------------------------------------------
# Six prompts that need up to 27 blocks in a pool of 12: the engine must swap and recompute.
PRESSURE = dict(block_size=4, num_gpu_blocks=12, num_cpu_blocks=6, preemption_mode="swap", device="cpu")
# Three samples of each of four prompts that share a 12-token system prompt through prefix
# caching: blocks held by several sequences and the cache at once, freed one owner at a time.
SHARING = dict(block_size=4, num_gpu_blocks=40, num_cpu_blocks=8, preemption_mode="swap", watermark=0.0,
               enable_prefix_caching=True, device="cpu")
MAX_TOKENS = 10
MAX_STEPS = 500


@engine.check(3, "pass the allocator checks first; parallel samples fork their prompt's blocks and prefix "
                 "caching holds blocks too: free() must drop one owner, never the block while others hold it")
def shares_blocks(cls, rng: random.Random) -> dict:
    system = random_tokens(rng, 12)
    return _serve(cls, SHARING, [system + random_tokens(rng, 2 + i) for i in range(4)], n=3)


@engine.check(2, "under memory pressure the engine swaps and recomputes; it needs exact free counts, and every "
                 "block must be free again once all requests finish")
def serves_under_pressure(cls, rng: random.Random) -> dict:
    return _serve(cls, PRESSURE, [random_tokens(rng, 5 + i) for i in range(6)], n=1)


def _serve(make_allocator, config: dict, prompts: list, n: int) -> dict:
    """Serve ``prompts`` step by step with ``make_allocator`` for both pools, checking bookkeeping after each step."""
    from kvlib import LLM, EngineConfig, SamplingParams

    pools = []

    def tracked(num_blocks: int):
        pools.append(make_allocator(num_blocks))
        return pools[-1]

    llm = LLM("default", EngineConfig(**config), allocator=tracked, verbose=False)
    outputs = serve_checked(llm, prompts, SamplingParams(max_tokens=MAX_TOKENS, n=n), MAX_STEPS)
    cache = llm.engine.block_manager.cache
    seen = {"rejections": [out.error for out in outputs],
            "tokens of each request's samples": [[s.token_ids for s in out.samples] for out in outputs],
            "blocks the prefix cache holds at the end": cache.num_cached if cache else 0}
    for name, pool in zip(("device", "host"), pools):
        seen[f"{name} pool at the end: blocks owned, num_free"] = [
            sum(1 for b in range(pool.num_blocks) if pool.ref_count(b)), pool.num_free]
    return seen
