"""Lab 10 checks: the learner's host tier for evicted prefix blocks, alone and inside the engine.

The learner writes a class with the ``kvlib.interfaces.HostPrefixTier`` protocol: ``put``,
``lookup``, ``touch``, ``evict_one``, ``__contains__``, ``__iter__`` and ``num_cached``, built with
the host pool's allocator. The unit checks drive it on kvlib's allocator, one rule per check:
what it keeps and finds, tokens verified against a hash collision, least recently used out first,
a block a move holds never evicted, one reference per kept block through a random workload. The
engine checks plug it in with ``LLM(..., host_prefix_tier=...)``: a conversation that returns
after other traffic evicted its prefix from the device, and a host pool too small for everything,
so the tier evicts while blocks are being copied back; block bookkeeping after every step, tokens
and prefix-cache counters compared with kvlib's own tier.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from functools import cache

from kvlib.block_allocator import BlockAllocator
from kvlib.config import SamplingParams
from kvlib.course.grading.checks import CheckFailed, Task, expect
from kvlib.course.grading.extract import Rules
from kvlib.course.grading.results import TaskResult
from kvlib.course.grading.serving import serve_checked
from kvlib.prefix_cache import CachedBlock, HostPrefixTier

GRADED = ("put", "lookup", "touch", "evict_one", "__contains__", "__iter__", "num_cached")
RULES = Rules(needs=("MyHostTier",), kvlib_imports={"kvlib.prefix_cache": {"CachedBlock"}}, own_methods=GRADED)
tier = Task("tier", RULES)
engine = Task("engine", RULES)
TASKS = [tier, engine]


def check_tier(tier_cls) -> TaskResult:
    return tier.grade(tier_cls)


def check_engine(tier_cls) -> TaskResult:
    return engine.grade(tier_cls)


def checked(tier_cls) -> type:
    """``tier_cls`` whose ``evict_one`` is held to its word: True forgets and frees one evictable block, False none."""
    class Checked(tier_cls):
        def __init__(self, allocator):
            super().__init__(allocator)
            self._graded_pool = allocator

        def __iter__(self):
            entries = list(super().__iter__())
            odd = [e for e in entries if not isinstance(e, CachedBlock)]
            if odd:
                raise CheckFailed(f"iterating the tier yielded {odd[0]!r}; it must yield the CachedBlock of each "
                                  f"kept block")
            return iter(entries)

        def evict_one(self):
            pool = self._graded_pool
            kept = {entry.block_id: pool.ref_count(entry.block_id) for entry in self}
            evictable = [block for block, count in kept.items() if count == 1]
            free = pool.num_free
            found = super().evict_one()
            gone = [block for block in kept if block not in {entry.block_id for entry in self}]
            freed = pool.num_free - free
            expect(found is True or found is False, f"evict_one returned {found!r}; it must return True or False")
            if not found:
                expect(not gone and freed == 0,
                       f"evict_one returned False but forgot {gone} and freed {freed} block(s)")
                if evictable:
                    raise CheckFailed(f"evict_one returned False, but host block {evictable[0]} could be evicted "
                                      f"(reference count 1): the host pool needed the room")
                return found
            expect(evictable, "evict_one returned True with nothing to evict (every kept block is held by a move, "
                              "or none is kept); it must return False then")
            expect(gone, "evict_one returned True but still keeps every block it kept: an evicted block must be "
                         "forgotten (no longer `in` the tier, nor iterated)")
            held = [block for block in gone if kept[block] > 1]
            if held:
                raise CheckFailed(f"evict_one evicted host block {held[0]}, whose reference count was {kept[held[0]]}: "
                                  f"a move of this step holds it; skip it and evict the least recently used block "
                                  f"whose count is 1")
            expect(len(gone) == 1 and freed == 1, f"evict_one forgot host block(s) {gone} and {freed} block(s) became "
                                                  f"free; it must forget one block and free it (allocator.free, once)")
            return found
    Checked.__name__ = tier_cls.__name__
    return Checked


# ---- the tier on its own -----------------------------------------------------------------------
TOKENS = {11: (1, 2, 3, 4), 22: (5, 6, 7, 8), 33: (9, 10, 11, 12), 44: (13, 14, 15, 16)}


def _filled(cls, names=(11, 22, 33), num_blocks: int = 8):
    """A tier on a pool of ``num_blocks``, with one block put under each of ``names`` in that order."""
    pool = BlockAllocator(num_blocks)
    kept = checked(cls)(pool)
    blocks = {}
    for name in names:
        blocks[name] = pool.allocate()
        kept.put(name, TOKENS[name], blocks[name])
    return pool, kept, blocks


def _kept(t) -> list[int]:
    return [name for name in TOKENS if name in t]


@tier.check(2, "put keeps the block under its name without taking a reference of its own; lookup(name, tokens) "
               "returns the CachedBlock(name, block_id, tokens) kept there, or None; `name in tier`, iterating "
               "and num_cached describe what is kept")
def keeps_and_finds_blocks(cls) -> None:
    pool, t, blocks = _filled(cls)
    expect(t.num_cached == 3 and _kept(t) == [11, 22, 33],
           f"after putting blocks under names 11, 22 and 33, num_cached is {t.num_cached} and the names `in` the tier "
           f"are {_kept(t)}; expected 3 and [11, 22, 33]")
    for name, block in blocks.items():
        entry = t.lookup(name, TOKENS[name])
        got = None if entry is None else (entry.name, entry.block_id, entry.tokens)
        expect(got == (name, block, TOKENS[name]), f"lookup({name}, {TOKENS[name]}) gave {entry!r}; expected "
                                                   f"CachedBlock(name={name}, block_id={block}, tokens={TOKENS[name]})")
    expect(t.lookup(44, TOKENS[44]) is None, "lookup of a name nobody put returned a block; expected None")
    listed = sorted(entry.block_id for entry in t)
    expect(listed == sorted(blocks.values()), f"iterating the tier gave blocks {listed}; expected the CachedBlock of "
                                              f"each kept block, {sorted(blocks.values())}")
    counts = [pool.ref_count(b) for b in blocks.values()]
    expect(counts == [1, 1, 1], f"after put, the blocks' reference counts are {counts}; expected 1 each: the engine "
                                f"allocated them and hands its reference to the tier")


@tier.check(2, "names are hashes, and two runs of tokens can share one: lookup must compare the tokens it kept "
               "with those it is asked for, and a mismatch is a miss (None), not a hit")
def checks_the_tokens(cls) -> None:
    _, t, _ = _filled(cls, names=(11,))
    other = (1, 2, 3, 99)
    expect(t.lookup(11, other) is None,
           f"lookup(11, {other}) found the block kept under 11, which holds {TOKENS[11]}: a hash collision would "
           f"serve another prefix's K/V and corrupt every token after it")
    expect(t.lookup(11, TOKENS[11]) is not None and t.num_cached == 1,
           "after a miss on the tokens, the block kept under 11 must still be found with its own tokens")


@tier.check(2, "evict_one frees the least recently used block: put and touch(name) make a block the most "
               "recently used; lookup does not; it returns True, or False when there is nothing to evict")
def evicts_the_least_recently_used(cls) -> None:
    pool, t, blocks = _filled(cls)
    t.touch(11)
    t.put(44, TOKENS[44], pool.allocate())
    order = []
    for _ in range(4):
        before = _kept(t)
        expect(t.evict_one() is True, f"evict_one with {before} kept returned False; expected True")
        gone = [n for n in before if n not in t]
        expect(len(gone) == 1, f"one evict_one took {gone or 'nothing'} from the tier")
        order += gone
    expect(order == [22, 33, 11, 44], f"put 11, 22, 33, touch(11), put 44, then evict_one four times evicted "
                                      f"{order}; expected [22, 33, 11, 44], least recently used first")
    expect(t.evict_one() is False and t.num_cached == 0, "evict_one on an empty tier must return False")
    expect(pool.num_free == 8, f"after evicting every block, {pool.num_free} of 8 host blocks are free")


@tier.check(2, "a block whose reference count is above 1 is held by a move of this step: skip it, evict the next "
               "least recently used, and return False if every kept block is held")
def spares_held_blocks(cls) -> None:
    pool, t, blocks = _filled(cls, names=(11, 22))
    pool.fork(blocks[11])  # this step copies block 11 back to the device: it is held
    expect(t.evict_one() is True and _kept(t) == [11],
           f"with 11 (least recently used, but held by a move) and 22 kept, evict_one left {_kept(t)}; expected "
           f"[11]: 22 goes instead")
    expect(t.evict_one() is False and _kept(t) == [11] and pool.ref_count(blocks[11]) == 2,
           f"with only held block 11 kept, evict_one must return False and change nothing; 11 is "
           f"{'kept' if 11 in t else 'gone'}, its reference count {pool.ref_count(blocks[11])}")
    pool.free(blocks[11])  # the step's moves are done
    expect(t.evict_one() is True and t.num_cached == 0 and pool.ref_count(blocks[11]) == 0,
           "once the move's hold is let go, block 11 can be evicted, and its reference count drops to 0")


@tier.check(1, "through any mix of put, touch, lookup, holds and evict_one, the tier holds exactly one reference "
               "to each block it keeps and none to any other, and keeps exactly the blocks not yet evicted")
def random_workload(cls) -> None:
    for seed in range(4):
        rng = random.Random(seed)
        pool = BlockAllocator(12)
        t = checked(cls)(pool)
        model: OrderedDict[int, int] = OrderedDict()  # name -> block, least recently used first
        held: list[int] = []
        for step in range(150):
            op = rng.choice(["put", "put", "touch", "lookup", "hold", "release", "evict", "evict"])
            if op == "put" and pool.num_free:
                name, block = rng.randrange(10**6), pool.allocate()
                if name not in model:
                    t.put(name, (name,), block)
                    model[name] = block
                else:
                    pool.free(block)
            elif op in ("touch", "lookup") and model:
                name = rng.choice(list(model))
                if op == "touch":
                    t.touch(name)
                    model.move_to_end(name)
                else:
                    expect(t.lookup(name, (name,)) is not None, f"workload {seed}, step {step}: lookup of kept "
                                                                f"block {name} found nothing")
            elif op == "hold" and model:
                held.append(pool.fork(rng.choice(list(model.values()))))
            elif op == "release" and held:
                pool.free(held.pop(rng.randrange(len(held))))
            elif op == "evict":
                victim = next((n for n, b in model.items() if pool.ref_count(b) == 1), None)
                found = t.evict_one()
                could = f"block {victim}" if victim is not None else "no block"
                expect(found == (victim is not None),
                       f"workload {seed}, step {step}: evict_one returned {found}, but {could} could be evicted")
                if victim is not None:
                    del model[victim]
            kept = sorted(e.block_id for e in t)
            expect(kept == sorted(model.values()) and t.num_cached == len(model),
                   f"workload {seed}, after {op} at step {step}: the tier keeps blocks {kept} (num_cached "
                   f"{t.num_cached}); expected {sorted(model.values())}")
            holds = {b: held.count(b) for b in held}
            for block in range(pool.num_blocks):
                want = (block in model.values()) + holds.get(block, 0)
                expect(pool.ref_count(block) == want, f"workload {seed}, after {op} at step {step}: host block {block} "
                                                      f"has reference count {pool.ref_count(block)}; expected {want}")


# ---- engine --------------------------------------------------------------------------------------
def _tokens(seed: int, n: int) -> list[int]:
    return [(37 * seed + 11 * j) % 250 + 3 for j in range(n)]


CONFIG = dict(block_size=4, num_gpu_blocks=32, enable_prefix_caching=True, host_prefix_cache=True, watermark=0.0)
SHORT, LONG = SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=8, ignore_eos=True)
CONVERSATION = _tokens(1, 40)
A, B = _tokens(3, 40), _tokens(4, 40)
# Each workload is (host blocks, phases); a phase is a batch of prompts served to completion, and
# a callable prompt is built from the outputs of the phases before it.
WORKLOADS = {
    # A 40-token conversation, then four 40-token requests that evict it from the 32-block device
    # pool, then the conversation returns with its reply and 8 new tokens.
    "returning": (48, [([CONVERSATION], LONG), ([_tokens(10 + i, 40) for i in range(4)], SHORT),
                       ([lambda outs: CONVERSATION + outs[0][0][0] + _tokens(2, 8)], LONG)]),
    # Two conversations, traffic, one of them returns, more traffic, both return: the 24-block host
    # pool cannot keep everything, so the tier evicts, sometimes while it copies blocks back.
    "crowded": (24, [([A, B], SHORT), ([_tokens(20 + i, 40) for i in range(3)], SHORT), ([A + _tokens(5, 4)], SHORT),
                     ([_tokens(30 + i, 40) for i in range(3)], SHORT),
                     ([B + _tokens(6, 4), A + _tokens(7, 4)], SHORT)]),
}
MAX_STEPS = 500


@engine.check(3, "pass the tier checks first; a returning conversation finds its evicted prefix through lookup, "
                 "and its blocks are copied back instead of recomputed")
def copies_a_returning_conversation_back(cls) -> None:
    mine = _expect_same_as_reference(cls, "returning")
    expect(mine["host_hit_tokens"] > 0, "the returning conversation found nothing on the host tier")


@engine.check(3, "pass the tier checks first; with a host pool too small for every prefix, evict_one must free the "
                 "least recently used block nobody is copying, one reference each")
def evicts_under_pressure(cls) -> None:
    _expect_same_as_reference(cls, "crowded")


def _expect_same_as_reference(cls, workload: str) -> dict:
    expected_tokens, expected = _reference(workload)
    tokens, mine = _serve(checked(cls), workload)
    for i, (got, want) in enumerate(zip(tokens, expected_tokens)):
        expect(got == want, f"request {i} generated {got} with your host tier but {want} with kvlib's")
    for key, what in (("host_hit_tokens",
                       "prompt tokens found on the host tier (metrics.prefix_cache_host_hit_tokens)"),
                      ("hit_tokens", "prompt tokens found in the prefix cache (metrics.prefix_cache_hit_tokens)"),
                      ("host_copies", "blocks copied over the host link")):
        expect(mine[key] == expected[key], f"{what}: {mine[key]} with your host tier, {expected[key]} with kvlib's")
    return mine


@cache
def _reference(workload: str) -> tuple:
    return _serve(HostPrefixTier, workload)


def _serve(tier_cls, workload: str) -> tuple[list, dict]:
    from kvlib import LLM, EngineConfig

    host_blocks, phases = WORKLOADS[workload]
    llm = LLM("default", EngineConfig(device="cpu", num_cpu_blocks=host_blocks, **CONFIG), host_prefix_tier=tier_cls,
              verbose=False)
    outs = []
    for prompts, params in phases:
        prompts = [p(outs) if callable(p) else p for p in prompts]
        outs.append([[s.token_ids for s in out.samples] for out in serve_checked(llm, prompts, params, MAX_STEPS)])
    m = llm.metrics
    return ([tokens for phase in outs for tokens in phase],
            dict(host_hit_tokens=m.prefix_cache_host_hit_tokens, hit_tokens=m.prefix_cache_hit_tokens,
                 host_copies=m.swap_bytes // llm.engine.runner.spec.block_bytes))
