"""Lab 05 checks: the learner's fork and copy-on-write, alone and inside the engine.

The learner writes a class with the two methods of the ``BlockSharing`` protocol
(``kvlib/interfaces.py``): ``fork(allocator, blocks)`` and ``make_writable(allocator, blocks, index,
take_block)``. While grading, kvlib's own (:class:`kvlib.core.sharing.BlockSharing`) is a stub. The unit
checks drive the learner's methods on kvlib's :class:`~kvlib.core.block_allocator.BlockAllocator` with
pool sizes, block ids, owner counts and indices drawn from the seed, one rule per check, and observe
the tables, reference counts and free blocks; each observation is compared with kvlib's own sharing
on the same inputs. The engine checks pass an instance as ``LLM(..., block_sharing=...)``, serve
requests with n > 1 samples (greedy, seeded, under preemption, with prefix caching in a pool that
cached blocks fill, where a copy's block must come from ``take_block``), check the block
bookkeeping after every step, and observe every sample's tokens and the copies the engine made.
"""
from __future__ import annotations

import random
from typing import Callable

from kvlib import interfaces
from kvlib.config import SamplingParams
from kvlib.core.block_allocator import BlockAllocator, BlockAllocatorError
from kvlib.course.grading.checks import Task, expect, raised
from kvlib.course.grading.decisions import acts_on
from kvlib.course.grading.hidden import kvlibs_own
from kvlib.course.grading.serving import random_tokens, serve_checked
from kvlib.course.grading.workloads import Arrival, serve_timed

HIDDEN = ("kvlib.core.sharing:BlockSharing",)
_sharing = kvlibs_own(HIDDEN[0])
# Each call's acts come back from the sandbox; the grader does them again to its own pool and engine (all checks).
ACTS = acts_on(interfaces.BlockSharing, acts=("allocate", "fork", "free"), errors=(BlockAllocatorError,))

fork = Task("fork", ("MyBlockSharing",), HIDDEN, _sharing, decisions=ACTS)
copy_on_write = Task("copy_on_write", ("MyBlockSharing",), HIDDEN, _sharing, decisions=ACTS)
engine = Task("engine", ("MyBlockSharing",), HIDDEN, _sharing, decisions=ACTS)
TASKS = [fork, copy_on_write, engine]
check_fork, check_copy_on_write, check_engine = fork.grade, copy_on_write.grade, engine.grade


def _pool_with(rng: random.Random, blocks_wanted: int) -> tuple[BlockAllocator, list[int]]:
    """A pool with a few free blocks and a table of ``blocks_wanted`` blocks in an order drawn from ``rng``."""
    pool = BlockAllocator(blocks_wanted + rng.randint(3, 8))
    taken = [pool.allocate() for _ in range(pool.num_blocks)]
    table = rng.sample(taken, blocks_wanted)
    for block in taken:
        if block not in table:
            pool.free(block)
    return pool, table


def _state(pool: BlockAllocator) -> list:
    return [[pool.ref_count(b) for b in range(pool.num_blocks)], pool.num_free]


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
def same_blocks(cls, rng: random.Random) -> dict:
    seen = {}
    for size in (rng.randint(2, 6), 1, 0):
        pool, parent = _pool_with(rng, size)
        seen[f"fork of the table {parent}"] = list(cls().fork(pool, list(parent)))
    return seen


@fork.check(2, "call allocator.fork(block) once per block: each block gets exactly one more owner; "
               "fork allocates nothing and copies nothing")
def one_more_owner(cls, rng: random.Random) -> dict:
    pool, parent = _pool_with(rng, rng.randint(1, 6))
    seen = {"every ref_count, num_free before": _state(pool)}
    child = cls().fork(pool, list(parent))
    seen[f"every ref_count, num_free after forking {parent}"] = _state(pool)
    cls().fork(pool, list(child))
    seen["every ref_count, num_free after forking the child too"] = _state(pool)
    return seen


@fork.check(1, "return a new list: share the blocks, not the table; the child's table grows on its own")
def separate_tables(cls, rng: random.Random) -> dict:
    pool, parent = _pool_with(rng, rng.randint(1, 5))
    given = list(parent)
    child = cls().fork(pool, parent)
    child.append(pool.allocate())
    return {"fork returned the very list it was given": child is parent,
            f"the parent's table {given} after a block is appended to the child's": parent}


# ---- copy-on-write -----------------------------------------------------------------------------
@copy_on_write.check(2, "a block with ref_count 1 is private: return None and change nothing "
                        "(no new block, no reference dropped)")
def private_block_untouched(cls, rng: random.Random) -> dict:
    pool, table = _pool_with(rng, rng.randint(1, 5))
    index = rng.randrange(len(table))
    given = list(table)
    taken, take_block = _taker(pool)
    result = cls().make_writable(pool, table, index, take_block)
    return {f"make_writable(index={index}) of the private block {given[index]} returns": result,
            "the table after": table, "blocks take_block() handed out": len(taken),
            "every ref_count, num_free after": _state(pool)}


@copy_on_write.check(3, "a shared block: take one fresh block, put it at blocks[index], drop this table's "
                        "reference to the old block with allocator.free(old), and return (old, new): "
                        "the engine copies old into new; a block 2 tables share is shared too")
def shared_block_gets_a_copy(cls, rng: random.Random) -> dict:
    seen = {}
    for owners in (2, rng.randint(3, 5)):
        pool, table = _pool_with(rng, rng.randint(3, 6))
        index = rng.randrange(len(table) - 1)  # not the last block: the index says which one
        for _ in range(owners - 1):
            pool.fork(table[index])
        given = list(table)
        taken, take_block = _taker(pool)
        result = cls().make_writable(pool, table, index, take_block)
        seen[f"make_writable(index={index}) of {given}, block {given[index]} with {owners} owners: returns, "
             f"the table after, blocks taken"] = [list(result) if result else result, table, taken]
        seen[f"every ref_count, num_free after, {owners} owners"] = _state(pool)
    return seen


@copy_on_write.check(2, "every sharer that writes gets its own copy, except the last owner, which writes the "
                        "original in place (each writer that copies gives up its reference to the original, so the "
                        "last one finds it private); the other tables never change")
def every_writer_gets_its_own(cls, rng: random.Random) -> dict:
    pool, first = _pool_with(rng, rng.randint(1, 4))
    samples = rng.randint(2, 4)
    tables = [first] + [[pool.fork(b) for b in first] for _ in range(samples - 1)]
    index = len(first) - 1
    _, take_block = _taker(pool)
    sharing, seen = cls(), {}
    for writer in rng.sample(range(samples), samples):
        result = sharing.make_writable(pool, tables[writer], index, take_block)
        seen[f"sample {writer} writes block {index}: returns, then every table"] = [
            list(result) if result else result, [list(t) for t in tables]]
    seen["every ref_count, num_free after the writes"] = _state(pool)
    return seen


@copy_on_write.check(1, "get the new block by calling take_block(), never allocator.allocate(): when the pool is "
                        "full, the engine's take_block makes room by evicting a cached prefix block")
def uses_take_block(cls, rng: random.Random) -> dict:
    # Observes where the new block came from and nothing else, so that this hint is only ever given for
    # that mistake (what happens to the old block's references is shared_block_gets_a_copy's business).
    pool, table = _pool_with(rng, rng.randint(1, 4))
    index = rng.randrange(len(table))
    pool.fork(table[index])
    cached = [pool.allocate() for _ in range(pool.num_free)]  # the pool is full of blocks only the cache holds
    rng.shuffle(cached)
    handed_out: list[int] = []

    def take_block() -> int:
        pool.free(cached.pop())
        handed_out.append(pool.allocate())
        return handed_out[-1]
    given = list(table)
    error = raised(lambda: cls().make_writable(pool, table, index, take_block))
    return {f"make_writable(index={index}) of {given} in a full pool raises": error,
            "blocks take_block() handed out": len(handed_out),
            f"blocks[{index}] after is the block take_block() handed out": table[index] in handed_out}


# ---- inside the engine -------------------------------------------------------------------------
BLOCK_SIZE = 4
N, MAX_TOKENS = 3, 8
PRESSURE = dict(block_size=2, num_gpu_blocks=20, num_cpu_blocks=200, watermark=0.0)  # 4 requests x 3 samples outgrow it
MAX_STEPS = 500


def _prompts(rng: random.Random, lengths) -> list[list[int]]:
    return [random_tokens(rng, length) for length in lengths]


def _lengths(rng: random.Random) -> list[int]:
    """Prompt lengths ending mid-block (samples share and write the last block) and on a block boundary."""
    return [BLOCK_SIZE * rng.randint(1, 3) + rng.randint(1, BLOCK_SIZE - 1) for _ in range(3)] + \
        [BLOCK_SIZE * rng.randint(1, 4)]


def _observed(llm, outputs) -> dict:
    return {"tokens of each request's samples": [[s.token_ids for s in out.samples] for out in outputs],
            "copy-on-write copies": llm.metrics.num_cow_copies, "preemptions": llm.metrics.num_preemptions}


def _serve(cls, config: dict, prompts: list[list[int]], params) -> dict:
    """Serve ``prompts`` step by step with the sharing plugged in, checking block bookkeeping after every step."""
    from kvlib import LLM, EngineConfig

    llm = LLM("default", EngineConfig(device="cpu", **config), block_sharing=cls(), verbose=False)
    return _observed(llm, serve_checked(llm, prompts, params, MAX_STEPS))


@engine.check(2, "greedy samples are all the same sequence, so they must equal the n = 1 output; the engine "
                 "should copy each shared, partly filled prompt block once per sample but the last")
def greedy_samples(cls, rng: random.Random) -> dict:
    return _serve(cls, dict(block_size=BLOCK_SIZE, num_gpu_blocks=128), _prompts(rng, _lengths(rng)),
                  SamplingParams(max_tokens=MAX_TOKENS, n=N))


@engine.check(2, "seeded samples diverge from their first token; each must write its own copy of the shared "
                 "last prompt block, or one sample's K/V lands in another's history")
def seeded_samples(cls, rng: random.Random) -> dict:
    params = SamplingParams(max_tokens=MAX_TOKENS, n=N, temperature=1.0, seed=rng.randrange(10**6))
    return _serve(cls, dict(block_size=BLOCK_SIZE, num_gpu_blocks=128), _prompts(rng, _lengths(rng)), params)


@engine.check(3, "under memory pressure the engine preempts samples: swapping copies a shared block once and "
                 "recomputing drops only one reference, so your ref counts must stay exact")
def under_preemption(cls, rng: random.Random) -> dict:
    params = SamplingParams(max_tokens=MAX_TOKENS, n=N, temperature=1.0, seed=rng.randrange(10**6))
    prompts = _prompts(rng, [5, 7, 2 * rng.randint(2, 3) + 1, 2 * rng.randint(2, 3)])  # three end mid-block
    return {mode: _serve(cls, dict(PRESSURE, preemption_mode=mode), prompts, params) for mode in ("swap", "recompute")}


# Eight requests of 3 seeded samples that share a 12-token system prompt, two arriving every 10 steps,
# in a pool of 20 blocks: prefix caching keeps the finished requests' full blocks, so the pool fills
# with cached blocks nobody uses, and a copy's new block can only come from evicting one.
CACHED_CONFIG = dict(block_size=BLOCK_SIZE, num_gpu_blocks=20, enable_prefix_caching=True, watermark=0.0)


@engine.check(2, "with prefix caching the pool fills with cached blocks nobody uses; take a copy's block with "
                 "take_block(), which evicts one, and keep every reference count exact")
def with_prefix_caching(cls, rng: random.Random) -> dict:
    from kvlib import LLM, EngineConfig

    system = _prompts(rng, [3 * BLOCK_SIZE])[0]
    seed = rng.randrange(10**6)
    arrivals = [Arrival(10 * (k // 2), tuple(system + _prompts(rng, [rng.randint(1, 4)])[0]),
                        SamplingParams(max_tokens=MAX_TOKENS, n=N, temperature=1.0, seed=seed + k)) for k in range(8)]
    llm = LLM("default", EngineConfig(device="cpu", **CACHED_CONFIG), block_sharing=cls(), verbose=False)
    try:
        served = serve_timed(llm, arrivals, MAX_STEPS)
    except BlockAllocatorError as exc:
        expect("no free block" not in str(exc),
               f"the allocator raised {exc!r} while every free block was a cached prefix block nobody used: a "
               f"copy's new block must come from take_block(), which evicts one; allocator.allocate() does not")
        expect(False, f"the allocator raised {exc!r}: a reference was dropped more often than it was taken (a block "
                      f"freed while other sequences still held it)")
    return dict(_observed(llm, served.outputs), **{"prefix cache hit tokens": llm.metrics.prefix_cache_hit_tokens})
