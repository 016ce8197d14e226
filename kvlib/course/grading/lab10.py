"""Lab 10 checks: the learner's host tier for evicted prefix blocks, alone and inside the engine.

The learner writes a class with the ``kvlib.interfaces.HostPrefixTier`` protocol (kvlib's own tier is
hidden while it is graded). Unit checks drive it on kvlib's allocator with names, tokens and orders of use
drawn from the seed, one rule per check, observing what it keeps, finds and evicts; engine checks plug it
into ``LLM(..., host_prefix_tier=...)`` (a conversation returning after other traffic evicted its prefix,
a host pool too small for everything) and observe the tokens and prefix-cache counters.
"""
from __future__ import annotations

import random
from collections.abc import Iterator

from kvlib import interfaces
from kvlib.config import SamplingParams
from kvlib.core.block_allocator import BlockAllocator
from kvlib.core.prefix_cache import CachedBlock
from kvlib.course.grading.checks import CheckFailed, Task, expect
from kvlib.course.grading.decisions import acts_on
from kvlib.course.grading.hidden import kvlibs_own
from kvlib.course.grading.serving import random_tokens, serve_checked

HIDDEN = ("kvlib.core.prefix_cache:HostPrefixTier",)
_tier = kvlibs_own(HIDDEN[0])

# Each call's acts and answers come back from the sandbox; the grader does them again to its own pools and engine.
ACTS = acts_on(interfaces.HostPrefixTier, acts=("allocate", "fork", "free"), kinds=(CachedBlock,))
tier = Task("tier", ("MyHostTier",), HIDDEN, _tier, decisions=ACTS)
engine = Task("engine", ("MyHostTier",), HIDDEN, _tier, decisions=ACTS)
TASKS = [tier, engine]
check_tier, check_engine = tier.grade, engine.grade


def checked(tier_cls) -> type:
    """``tier_cls`` whose ``evict_one`` is held to its word: True forgets and frees one evictable block, False none."""
    class Checked(tier_cls):
        def __init__(self, allocator):
            super().__init__(allocator)
            self._graded_pool = allocator

        def __iter__(self):
            given = super().__iter__()
            expect(isinstance(given, Iterator), f"__iter__ returned a {type(given).__name__}; it must return an "
                                                f"iterator (iter(...) of the entries, or yield them)")
            entries = list(given)
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
                expect(not gone and freed == 0, f"evict_one returned False but forgot {gone}, freed {freed} block(s)")
                expect(not evictable, f"evict_one returned False, but host block {evictable[:1]} could be evicted "
                                      f"(reference count 1): the host pool needed the room")
                return found
            expect(evictable, "evict_one returned True with nothing to evict (every kept block is held by a move, "
                              "or none is kept); it must return False then")
            expect(gone, "evict_one returned True but still keeps every block it kept: an evicted block must be "
                         "forgotten (no longer `in` the tier, nor iterated)")
            held = [block for block in gone if kept[block] > 1]
            expect(not held, f"evict_one evicted host block {held[:1]}, held by a move of this step (reference count "
                             f"above 1); skip it and evict the least recently used block whose count is 1")
            expect(len(gone) == 1 and freed == 1, f"evict_one forgot host block(s) {gone} and {freed} block(s) became "
                                                  f"free; it must forget one block and free it (allocator.free, once)")
            return found
    Checked.__name__ = tier_cls.__name__
    return Checked


# ---- the tier on its own -----------------------------------------------------------------------
def _filled(cls, rng: random.Random, count: int, num_blocks: int = 16, others: int = 0):
    """A tier on a pool of ``num_blocks`` (``others`` of them taken by someone else, a swapped sequence say),
    with ``count`` blocks put under random names; the pool, the tier, [(name, tokens, block)] in order of put."""
    pool = BlockAllocator(num_blocks)
    for _ in range(others):
        pool.allocate()
    kept, entries = checked(cls)(pool), []
    for name in rng.sample(range(1, 2**62), count):
        entries.append((name, tuple(random_tokens(rng, 4)), pool.allocate()))
        kept.put(*entries[-1][:2], entries[-1][2])
    return pool, kept, entries


def _kept(t, entries) -> list[int]:
    """Which of ``entries`` (by their index) the tier keeps."""
    return [i for i, (name, _, _) in enumerate(entries) if name in t]


@tier.check(2, "put keeps the block under its name without taking a reference of its own; lookup(name, tokens) "
               "returns the CachedBlock(name, block_id, tokens) kept there, or None; `name in tier`, iterating "
               "and num_cached describe what the tier keeps (not the whole host pool)")
def keeps_and_finds_blocks(cls, rng: random.Random) -> dict:
    count, others = rng.randint(2, 6), rng.randint(1, 4)
    pool, t, entries = _filled(cls, rng, count, others=others)
    found = [t.lookup(name, tokens) for name, tokens, _ in entries]
    return {f"num_cached after {count} puts, {others} other host blocks in use": t.num_cached,
            "the puts `in` the tier": _kept(t, entries), "a name never put is `in` the tier": 0 in t,
            "lookup(name, tokens) of each: its name, block and tokens": [None if e is None else [
                e.name == n, e.block_id == b, e.tokens == k] for e, (n, k, b) in zip(found, entries)],
            "lookup of a name never put": t.lookup(0, entries[0][1]) is not None,
            "the blocks iterating the tier gives, sorted": sorted(e.block_id for e in t),
            "their reference counts": [pool.ref_count(b) for _, _, b in entries]}


@tier.check(2, "names are hashes, and two runs of tokens can share one: lookup must compare the tokens it kept "
               "with those it is asked for, and a mismatch is a miss (None), not a hit")
def checks_the_tokens(cls, rng: random.Random) -> dict:
    _, t, entries = _filled(cls, rng, rng.randint(1, 3))
    name, tokens, _ = entries[0]
    where = rng.randrange(len(tokens))
    other = tokens[:where] + (tokens[where] % 250 + 3,) + tokens[where + 1:]  # one token differs
    return {f"lookup with token {where} changed finds a block": t.lookup(name, other) is not None,
            "lookup with its own tokens, after that, finds a block": t.lookup(name, tokens) is not None,
            "num_cached": t.num_cached}


@tier.check(2, "evict_one frees the least recently used block: put and touch(name) make a block the most "
               "recently used; lookup does not; it returns True, or False when there is nothing to evict")
def evicts_the_least_recently_used(cls, rng: random.Random) -> dict:
    count = rng.randint(3, 6)
    pool, t, entries = _filled(cls, rng, count)
    touched = [0] + rng.sample(range(1, count), rng.randint(0, count - 2))  # the oldest and others, not all
    rng.shuffle(touched)
    for i in touched:
        t.touch(entries[i][0])
        t.lookup(*entries[rng.randrange(count)][:2])  # a lookup is no use
    t.lookup(*entries[min(set(range(count)) - set(touched))][:2])  # the least recently used, looked up
    order = []
    for _ in range(count):
        before = _kept(t, entries)
        found = t.evict_one()
        order.append([found, [i for i in before if i not in _kept(t, entries)]])
    return {f"put {count}, touch {touched}: each evict_one's answer and the puts it evicted": order,
            "evict_one on the empty tier": t.evict_one(), "host blocks free at the end": pool.num_free}


@tier.check(2, "a block whose reference count is above 1 is held by a move of this step: skip it, evict the next "
               "least recently used, and return False if every kept block is held")
def spares_held_blocks(cls, rng: random.Random) -> dict:
    count = rng.randint(2, 5)
    pool, t, entries = _filled(cls, rng, count)
    held = [0] + rng.sample(range(1, count), rng.randint(0, count - 2))  # the least recently used, not all
    for i in held:
        pool.fork(entries[i][2])  # this step copies it back to the device
    seen = {}
    for phase in ("while held", "once the moves let go"):
        answers = []
        while True:
            before = _kept(t, entries)
            answers.append([t.evict_one(), [i for i in before if i not in _kept(t, entries)]])
            if not answers[-1][0] or len(answers) > count:
                break
        seen[f"puts {held} of {count} held: evict_one's answers and the puts evicted, {phase}"] = answers
        for i in held if phase == "while held" else ():
            pool.free(entries[i][2])
    return {**seen, "host blocks free at the end": pool.num_free}


@tier.check(1, "through any mix of put, touch, lookup, holds and evict_one, the tier holds exactly one reference "
               "to each block it keeps and none to any other, and keeps exactly the blocks not yet evicted")
def random_workload(cls, rng: random.Random) -> dict:
    runs = {}
    for run in range(3):
        pool, trace, held = BlockAllocator(rng.randint(6, 12)), [], []
        t, names = checked(cls)(pool), {}  # name -> block of each put
        for _ in range(120):
            op = rng.choice(["put", "put", "touch", "lookup", "hold", "release", "evict", "evict"])
            live = [n for n in names if n in t]
            if op == "put" and pool.num_free:
                name = rng.randrange(1, 10**6)
                if name in t:
                    continue
                names[name] = pool.allocate()
                t.put(name, (name,), names[name])
            elif op == "touch" and live:
                t.touch(rng.choice(live))
            elif op == "lookup" and live:
                name = rng.choice(live)
                trace.append(["lookup finds it", t.lookup(name, (name,)) is not None])
            elif op == "hold" and live:
                held.append(pool.fork(names[rng.choice(live)]))
            elif op == "release" and held:
                pool.free(held.pop(rng.randrange(len(held))))
            elif op == "evict":
                trace.append(["evict_one", t.evict_one()])
            else:
                continue
            trace.append([op, sorted(e.block_id for e in t), t.num_cached, [pool.ref_count(b) for b in
                                                                            range(pool.num_blocks)]])
        runs[f"workload {run}: after each call, the blocks kept, num_cached, every reference count"] = trace
    return runs


# ---- engine --------------------------------------------------------------------------------------
CONFIG = dict(block_size=4, num_gpu_blocks=32, enable_prefix_caching=True, host_prefix_cache=True, watermark=0.0)
SHORT, LONG = SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=8, ignore_eos=True)
MAX_STEPS = 500
HOST_HITS = "prompt tokens found on the host tier (metrics.prefix_cache_host_hit_tokens)"


@engine.check(3, "pass the tier checks first; a returning conversation finds its evicted prefix through lookup, "
                 "and its blocks are copied back instead of recomputed")
def copies_a_returning_conversation_back(cls, rng: random.Random) -> dict:
    # A 40-token conversation, four 40-token requests that evict it from the 32-block device pool, then
    # the conversation returns with its reply and 8 new tokens.
    talk = random_tokens(rng, 40)
    seen = _serve(cls, 48, [([talk], LONG), ([random_tokens(rng, 40) for _ in range(4)], SHORT),
                            ([lambda outs: talk + outs[0][0][0] + random_tokens(rng, 8)], LONG)])
    expect(seen[HOST_HITS] > 0,
           "the returning conversation found nothing on the host tier")
    return seen


@engine.check(3, "pass the tier checks first; with a host pool too small for every prefix, evict_one must free the "
                 "least recently used block nobody is copying, one reference each")
def evicts_under_pressure(cls, rng: random.Random) -> dict:
    # Two conversations, traffic, one returns, more traffic, both return: the 24-block host pool cannot keep
    # everything, so the tier evicts, sometimes while it copies blocks back.
    a, b = random_tokens(rng, 40), random_tokens(rng, 40)
    traffic = [([random_tokens(rng, 40) for _ in range(3)], SHORT) for _ in range(2)]
    return _serve(cls, 24, [([a, b], SHORT), traffic[0], ([a + random_tokens(rng, 4)], SHORT), traffic[1],
                            ([b + random_tokens(rng, 4), a + random_tokens(rng, 4)], SHORT)])


def _serve(tier_cls, host_blocks: int, phases: list) -> dict:
    """Serve each phase (a batch of prompts, to completion; a callable prompt is built from the outputs before)."""
    from kvlib import LLM, EngineConfig

    llm = LLM("default", EngineConfig(device="cpu", num_cpu_blocks=host_blocks, **CONFIG),
              host_prefix_tier=checked(tier_cls), verbose=False)
    outs = []
    for prompts, params in phases:
        prompts = [p(outs) if callable(p) else p for p in prompts]
        outs.append([[s.token_ids for s in out.samples] for out in serve_checked(llm, prompts, params, MAX_STEPS)])
    m = llm.metrics
    return {**{f"request {i}: tokens": tokens for i, tokens in enumerate(t for phase in outs for t in phase)},
            HOST_HITS: m.prefix_cache_host_hit_tokens,
            "prompt tokens found in the prefix cache (metrics.prefix_cache_hit_tokens)": m.prefix_cache_hit_tokens,
            "blocks copied over the host link": m.swap_bytes // llm.engine.runner.spec.block_bytes}
