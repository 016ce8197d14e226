"""Lab 05 checks: the learner's fork and copy-on-write, alone and inside the engine.

The learner writes a class with the two methods of the ``BlockSharing`` protocol
(``kvlib/interfaces.py``): ``fork(allocator, blocks)`` and ``make_writable(allocator, blocks, index,
take_block)``; kvlib's own (:class:`kvlib.sharing.BlockSharing`) may not be imported. The unit
checks drive them on kvlib's :class:`~kvlib.block_allocator.BlockAllocator`, one rule per check, so
a bug costs the checks that cover it. The engine checks pass an instance as
``LLM(..., block_sharing=...)``, serve requests with n > 1 samples, check the block bookkeeping
after every step, and compare the tokens with what the sharing promises: greedy samples equal
the n = 1 output, and sample ``j`` of a request seeded ``s`` equals a separate request seeded
``sample_stream_seed(s, j)`` (the stream the engine derives for that sample), with and without
preemption, and with prefix caching in a pool that cached blocks fill, where a copy's block must
come from ``take_block`` (which evicts one).
"""
from __future__ import annotations

from functools import cache
from typing import Callable

from kvlib.block_allocator import BlockAllocator, BlockAllocatorError
from kvlib.config import SamplingParams
from kvlib.course.grading.checks import Task, expect
from kvlib.course.grading.extract import Rules
from kvlib.course.grading.results import TaskResult
from kvlib.course.grading.serving import serve_checked
from kvlib.course.grading.workloads import Arrival, serve_timed

RULES = Rules(needs=('MyBlockSharing',), kvlib_imports={}, own_methods=('fork', 'make_writable'))
fork = Task("fork", RULES)
copy_on_write = Task("copy_on_write", RULES)
engine = Task("engine", RULES)
TASKS = [fork, copy_on_write, engine]


def check_fork(sharing_cls) -> TaskResult:
    return fork.grade(sharing_cls)


def check_copy_on_write(sharing_cls) -> TaskResult:
    return copy_on_write.grade(sharing_cls)


def check_engine(sharing_cls) -> TaskResult:
    return engine.grade(sharing_cls)


def _pool_with(blocks_wanted: int) -> tuple[BlockAllocator, list[int]]:
    """A pool of 8 and a table of ``blocks_wanted`` blocks whose ids are not simply 0, 1, 2, ..., with 2 free blocks."""
    pool = BlockAllocator(8)
    taken = [pool.allocate() for _ in range(blocks_wanted + 2)]
    pool.free(taken[0])
    pool.free(taken[2])
    return pool, list(reversed(taken[3:])) + [taken[1]]


def _counts(pool: BlockAllocator) -> list[int]:
    return [pool.ref_count(b) for b in range(pool.num_blocks)]


def _taker(pool: BlockAllocator) -> tuple[list[int], Callable[[], int]]:
    """A ``take_block`` like the engine's, recording the blocks it hands out."""
    taken: list[int] = []

    def take_block() -> int:
        taken.append(pool.allocate())
        return taken[-1]
    return taken, take_block


# ---- fork --------------------------------------------------------------------------------------
@fork.check(2, "fork(allocator, blocks) returns the parent's block ids, all of them, in the same order: "
               "the child reads the same KV through the same blocks")
def same_blocks(cls) -> None:
    pool, parent = _pool_with(3)
    expected = list(parent)
    child = cls().fork(pool, list(parent))
    expect(list(child) == expected, f"fork of a table {expected} returned {child}; expected {expected}")
    expect(cls().fork(pool, []) == [], "fork of an empty table must return an empty table")


@fork.check(2, "call allocator.fork(block) once per block: each block gets exactly one more owner; "
               "fork allocates nothing and copies nothing")
def one_more_owner(cls) -> None:
    pool, parent = _pool_with(3)
    before, free = _counts(pool), pool.num_free
    child = cls().fork(pool, list(parent))
    for block in parent:
        expect(pool.ref_count(block) == before[block] + 1,
               f"after fork, block {block} has ref_count {pool.ref_count(block)}; expected {before[block] + 1} "
               f"(the parent and the child)")
    expect(pool.num_free == free, f"fork changed the free blocks from {free} to {pool.num_free}; sharing allocates nothing")
    cls().fork(pool, list(child))
    expect(all(pool.ref_count(b) == before[b] + 2 for b in parent),
           f"after forking the child again, ref counts are {[pool.ref_count(b) for b in parent]}; "
           f"expected {[before[b] + 2 for b in parent]}")


@fork.check(1, "return a new list: share the blocks, not the table; the child's table grows on its own")
def separate_tables(cls) -> None:
    pool, parent = _pool_with(2)
    expected = list(parent)
    child = cls().fork(pool, parent)
    expect(child is not parent, "fork returned the very list it was given; a block appended to the child's table "
                                "would appear in the parent's")
    expect(parent == expected, f"fork changed the parent's table from {expected} to {parent}")


# ---- copy-on-write -----------------------------------------------------------------------------
@copy_on_write.check(2, "a block with ref_count 1 is private: return None and change nothing "
                        "(no new block, no reference dropped)")
def private_block_untouched(cls) -> None:
    pool, table = _pool_with(3)
    expected, counts = list(table), _counts(pool)
    taken, take_block = _taker(pool)
    result = cls().make_writable(pool, table, 2, take_block)
    expect(result is None, f"make_writable of a private block returned {result}; expected None")
    expect(table == expected and not taken and _counts(pool) == counts,
           f"make_writable of a private block changed the table to {table} (was {expected}), took {len(taken)} "
           f"block(s) or changed ref counts; a private block is written in place")


@copy_on_write.check(3, "a shared block: take one fresh block, put it at blocks[index], drop this table's "
                        "reference to the old block with allocator.free(old), and return (old, new): "
                        "the engine copies old into new")
def shared_block_gets_a_copy(cls) -> None:
    pool, table = _pool_with(3)
    old = table[2]
    pool.fork(old)
    pool.fork(old)  # two other sequences share the last block
    head, used = table[:2], pool.num_used
    _, take_block = _taker(pool)
    result = cls().make_writable(pool, table, 2, take_block)
    new = table[2]
    expect(table[:2] == head, f"make_writable(index=2) changed other entries: the table starts {table[:2]}, was {head}")
    expect(new != old and pool.ref_count(new) == 1,
           f"after make_writable of a block 3 tables share, the writer's entry is block {new} with ref_count "
           f"{pool.ref_count(new)}; expected a fresh block (not {old}) with ref_count 1")
    expect(pool.ref_count(old) == 2, f"block {old} was shared by 3 tables; after one of them copied it, its ref_count "
                                     f"is {pool.ref_count(old)}; expected 2 (the other two keep it)")
    expect(pool.num_used == used + 1, f"one copy should use one more block: num_used went from {used} to {pool.num_used}")
    expect(result == (old, new), f"make_writable returned {result}; expected (source, destination) = ({old}, {new})")


@copy_on_write.check(2, "every sharer that writes gets its own copy, except the last owner, which writes the "
                        "original in place; the other tables never change")
def every_writer_gets_its_own(cls) -> None:
    pool = BlockAllocator(8)
    full, tail = pool.allocate(), pool.allocate()
    tables = [[full, tail]] + [[pool.fork(full), pool.fork(tail)] for _ in range(2)]  # three samples, one prompt
    _, take_block = _taker(pool)
    sharing, results = cls(), []
    for writer, table in enumerate(tables):
        others = [list(t) for i, t in enumerate(tables) if i != writer]
        results.append(sharing.make_writable(pool, table, 1, take_block))
        expect([t for i, t in enumerate(tables) if i != writer] == others,
               f"when sample {writer} made block {tail} writable, another sample's table changed")
    tails = [t[1] for t in tables]
    expect(len(set(tails)) == 3 and tail in tails,
           f"after three samples wrote into their shared last block {tail}, their last blocks are {tails}; "
           f"expected three different blocks, one of them the original {tail}")
    expect(all(pool.ref_count(b) == 1 for b in tails) and pool.ref_count(full) == 3,
           f"ref counts after the writes: last blocks {[pool.ref_count(b) for b in tails]}, shared first block "
           f"{pool.ref_count(full)}; expected 1 each and 3")
    copies = [r for r in results if r is not None]
    expect(len(copies) == 2 and all(src == tail for src, _ in copies),
           f"the three writes returned {results}; expected two copies out of block {tail} and one None")


@copy_on_write.check(1, "get the new block by calling take_block(), never allocator.allocate(): when the pool is "
                        "full, the engine's take_block makes room by evicting a cached prefix block")
def uses_take_block(cls) -> None:
    pool = BlockAllocator(4)
    table = [pool.allocate(), pool.allocate()]
    pool.fork(table[1])
    cached = [pool.allocate(), pool.allocate()]  # the pool is full; two blocks only the prefix cache holds

    def take_block() -> int:
        pool.free(cached.pop())
        return pool.allocate()
    old = table[1]
    result = cls().make_writable(pool, table, 1, take_block)
    expect(result == (old, table[1]) and table[1] != old,
           f"with a full pool, make_writable returned {result} and left the table {table}")


# ---- inside the engine -------------------------------------------------------------------------
BLOCK_SIZE = 4
PROMPTS = [[(5 * i + j) % 250 + 3 for j in range(length)] for i, length in enumerate((6, 9, 13, 16))]
N, MAX_TOKENS, SEED = 3, 8, 11
MID_BLOCK = sum(1 for p in PROMPTS if len(p) % BLOCK_SIZE)  # prompts whose last block the samples share and write
PRESSURE = dict(block_size=2, num_gpu_blocks=20, num_cpu_blocks=200, watermark=0.0)  # 4 requests x 3 samples outgrow it
PRESSURE_PROMPTS = [[i + 3, i + 4, i + 5, i + 6, i + 7] for i in range(4)]
PRESSURE_TOKENS = 8
MAX_STEPS = 500


@engine.check(2, "greedy samples are all the same sequence, so they must equal the n = 1 output; the engine "
                 "should copy each shared, partly filled prompt block once per sample but the last")
def greedy_samples(cls) -> None:
    from kvlib import SamplingParams
    llm, outs = _serve(dict(block_size=BLOCK_SIZE, num_gpu_blocks=128), PROMPTS,
                       SamplingParams(max_tokens=MAX_TOKENS, n=N), cls())
    for i, (samples, single) in enumerate(zip(outs, _greedy_reference())):
        expect(samples == [single] * N, f"request {i}: greedy samples {samples}, but the n = 1 output is {single}")
    copies, expected = llm.metrics.num_cow_copies, (N - 1) * MID_BLOCK
    expect(copies == expected, f"the engine made {copies} copy-on-write copies; expected {expected}: {N - 1} for each "
                               f"of the {MID_BLOCK} prompts that end mid-block")


@engine.check(2, "seeded samples diverge from their first token; each must write its own copy of the shared "
                 "last prompt block, or one sample's K/V lands in another's history")
def seeded_samples(cls) -> None:
    from kvlib import SamplingParams
    _, outs = _serve(dict(block_size=BLOCK_SIZE, num_gpu_blocks=128), PROMPTS,
                     SamplingParams(max_tokens=MAX_TOKENS, n=N, temperature=1.0, seed=SEED), cls())
    _expect_separate(outs, _seeded_reference(tuple(map(tuple, PROMPTS)), MAX_TOKENS, (SEED,) * len(PROMPTS)), "")


@engine.check(3, "under memory pressure the engine preempts samples: swapping copies a shared block once and "
                 "recomputing drops only one reference, so your ref counts must stay exact")
def under_preemption(cls) -> None:
    from kvlib import SamplingParams
    params = SamplingParams(max_tokens=PRESSURE_TOKENS, n=N, temperature=1.0, seed=SEED)
    reference = _seeded_reference(tuple(map(tuple, PRESSURE_PROMPTS)), PRESSURE_TOKENS, (SEED,) * len(PRESSURE_PROMPTS))
    for mode in ("swap", "recompute"):
        llm, outs = _serve(dict(PRESSURE, preemption_mode=mode), PRESSURE_PROMPTS, params, cls())
        expect(llm.metrics.num_preemptions > 0, f"the {mode} run was meant to preempt but did not")
        _expect_separate(outs, reference, f" with {mode} preemption")


def _expect_separate(outs: list[list[list[int]]], reference: tuple, where: str) -> None:
    for i, samples in enumerate(outs):
        for j, (mine, theirs) in enumerate(zip(samples, reference[i])):
            expect(mine == list(theirs), f"request {i}, sample {j}{where}: {mine}, but a separate request drawing "
                                         f"from sample {j}'s stream gives {list(theirs)}")


@cache
def _greedy_reference() -> tuple:
    from kvlib import LLM, EngineConfig, SamplingParams
    llm = LLM("default", EngineConfig(block_size=BLOCK_SIZE, num_gpu_blocks=128, device="cpu"), verbose=False)
    return tuple(o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS)))


@cache
def _seeded_reference(prompts: tuple, max_tokens: int, seeds: tuple) -> tuple:
    """Sample ``j`` of each prompt as a request of its own, drawing from sample ``j``'s stream, in a roomy pool."""
    from kvlib import LLM, EngineConfig, SamplingParams
    from kvlib.sequence import sample_stream_seed
    llm = LLM("default", EngineConfig(block_size=BLOCK_SIZE, num_gpu_blocks=1024, device="cpu"), verbose=False)
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=sample_stream_seed(seed, j))
              for seed in seeds for j in range(N)]
    outs = llm.generate([list(p) for p in prompts for _ in range(N)], params)
    return tuple(tuple(o.token_ids for o in outs[N * i:N * (i + 1)]) for i in range(len(prompts)))


def _serve(config: dict, prompts: list[list[int]], params, sharing) -> tuple:
    """Serve ``prompts`` step by step with ``sharing`` plugged in, checking block bookkeeping after every step."""
    from kvlib import LLM, EngineConfig

    llm = LLM("default", EngineConfig(device="cpu", **config), block_sharing=sharing, verbose=False)
    outputs = serve_checked(llm, prompts, params, MAX_STEPS)
    return llm, [[s.token_ids for s in out.samples] for out in outputs]


# Eight requests of 3 seeded samples that share a 12-token system prompt, two arriving every 10 steps,
# in a pool of 20 blocks: prefix caching keeps the finished requests' full blocks, so the pool fills
# with cached blocks nobody uses, and a copy's new block can only come from evicting one.
SYSTEM = tuple((11 * j) % 250 + 3 for j in range(12))
CACHED = tuple(Arrival(10 * (k // 2), SYSTEM + tuple((5 * k + j) % 250 + 3 for j in range(2 + k % 3)),
                       SamplingParams(max_tokens=MAX_TOKENS, n=N, temperature=1.0, seed=SEED + k))
               for k in range(8))
CACHED_CONFIG = dict(block_size=BLOCK_SIZE, num_gpu_blocks=20, enable_prefix_caching=True, watermark=0.0)


@engine.check(2, "with prefix caching the pool fills with cached blocks nobody uses; take a copy's block with "
                 "take_block(), which evicts one, and keep every reference count exact")
def with_prefix_caching(cls) -> None:
    from kvlib import LLM, EngineConfig

    llm = LLM("default", EngineConfig(device="cpu", **CACHED_CONFIG), block_sharing=cls(), verbose=False)
    try:
        served = serve_timed(llm, list(CACHED), MAX_STEPS)
    except BlockAllocatorError as exc:
        if "no free block" in str(exc):
            expect(False, f"the allocator raised {exc!r} while every free block was a cached prefix block nobody "
                          f"used: a copy's new block must come from take_block(), which evicts one; "
                          f"allocator.allocate() does not")
        expect(False, f"the allocator raised {exc!r}: a reference was dropped more often than it was taken (a block "
                      f"freed while other sequences still held it)")
    expect(llm.metrics.prefix_cache_hit_tokens > 0, "the workload was meant to hit the prefix cache but did not")
    seeds = tuple(a.params.seed for a in CACHED)
    reference = _seeded_reference(tuple(a.prompt for a in CACHED), MAX_TOKENS, seeds)
    _expect_separate([[s.token_ids for s in out.samples] for out in served.outputs], reference,
                     " with prefix caching")
    mid_block = sum(1 for a in CACHED if len(a.prompt) % BLOCK_SIZE)
    copies = llm.metrics.num_cow_copies
    expect(copies == (N - 1) * mid_block, f"the engine made {copies} copy-on-write copies with prefix caching; "
                                          f"expected {(N - 1) * mid_block}: {N - 1} for each of the {mid_block} "
                                          f"prompts that end mid-block")
