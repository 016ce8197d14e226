"""Lab 06 checks: the learner's preemption mechanisms (a BlockManager subclass), alone and in the engine.

Unit checks act on sequences sized from the seed, one rule per check, observing moves, tables and reference
counts (kvlib's own methods set a scene only where the task leaves them). Engine checks serve swapping,
recomputing, partial and host-starved workloads (tokens, preemption counters); all run in the grader (``MOVES``).
"""
from __future__ import annotations

import random
from collections import Counter
from functools import partial

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.core.pieces import Pieces, build_core
from kvlib.core.sequence import Sequence
from kvlib.course.grading.checks import Task, expect
from kvlib.course.grading.hidden import kvlibs_own
from kvlib.course.grading.overrides import PREEMPTION_MECHANISMS, overrides_of
from kvlib.course.grading.serving import random_tokens, serve_checked

HIDDEN = {name: f"kvlib.core.block_manager:BlockManager.{name}" for name in PREEMPTION_MECHANISMS.methods}
_block_manager = kvlibs_own("kvlib.core.block_manager:BlockManager")
MOVES = overrides_of(PREEMPTION_MECHANISMS)
SWAP = tuple(HIDDEN[k] for k in HIDDEN if k != "drop")
swap = Task("swap", ("MyBlockManager",), SWAP, _block_manager, decisions=MOVES)
drop = Task("drop", ("MyBlockManager",), (HIDDEN["drop"],), _block_manager, decisions=MOVES)
engine = Task("engine", ("MyBlockManager",), tuple(HIDDEN.values()), _block_manager, decisions=MOVES)
TASKS = [swap, drop, engine]
check_swap, check_drop, check_engine = swap.grade, drop.grade, engine.grade
BS = 4

# ---- the scene -----------------------------------------------------------------------------------
def scene(cls, *sizes: int, gpu: int = 16, cpu: int = 16) -> list:  # the learner's manager, a sequence per size
    config = EngineConfig(block_size=BS, num_gpu_blocks=gpu, num_cpu_blocks=cpu, watermark=0.0)
    bm, _ = build_core(config, Pieces(block_manager=cls).with_defaults(config), num_device_blocks=gpu, block_bytes=1)
    return [bm] + [sequence(bm, "abc"[i], size) for i, size in enumerate(sizes)]


def sequence(bm, name: str, num_tokens: int, computed=None) -> Sequence:  # computed: default all
    seq = Sequence(name, list(range(100, 100 + num_tokens)), SamplingParams(), BS, 0.0)
    step(bm, lambda: bm.grow(seq, num_tokens))
    seq.num_computed_tokens = seq.peak_computed_tokens = num_tokens if computed is None else computed
    return seq


def step(bm, action) -> tuple:  # action() inside one step: the step's moves, what action returned
    bm.begin_step()
    result = action()
    return bm.end_step(), result


def on_host_by_hand(bm, seq: Sequence, count: int) -> None:  # a swap-in's scene: the last count blocks on the host
    seq.host_blocks = [bm.take_host() for _ in range(count)] + seq.host_blocks
    bm.release(seq, count)


def counts(bm, seqs: list[Sequence], where: str) -> dict:  # each block's holders are its reference count
    for name, pool, owners in (("device", bm.device_pool, Counter(b for s in seqs for b in s.block_table.blocks)),
                               ("host", bm.host_pool, Counter(b for s in seqs for b in s.host_blocks))):
        for block in range(pool.num_blocks):
            expect(pool.ref_count(block) == owners[block], f"{where}: {name} block {block} has reference count "
                                                           f"{pool.ref_count(block)}, held by {owners[block]}")
    return {f"{where}: device, host blocks free": [bm.device_pool.num_free, bm.host_pool.num_free]}


def positions(blocks: list, table: list) -> list:  # where each of blocks sits in table: what moved, whatever the ids
    return [table.index(b) if b in table else None for b in blocks]


# ---- swap ----------------------------------------------------------------------------------------
@swap.check(2, "swap_out(seq) plans one copy_out(device, host) per block, in table order, lists "
               "the hosts in seq.host_blocks, lets go of the device blocks (release); computed tokens stay")
def swaps_out_a_whole_sequence(cls, rng: random.Random) -> dict:
    bm, a = scene(cls, n := rng.choice([rng.randint(2, 7) * BS, rng.randint(5, 30)]))  # a multiple of BS, or any
    device = list(a.block_table.blocks)
    moves = step(bm, lambda: bm.swap_out(a))[0].swap_out
    return {f"table positions of the blocks moves.swap_out copies ({n} tokens)": positions([d for d, _ in moves],
                                                                                            device),
            "seq.host_blocks are the moves' host blocks, in order": a.host_blocks == [h for _, h in moves],
            "device blocks the sequence holds after": len(a.block_table),
            "num_computed_tokens after": a.num_computed_tokens, **counts(bm, [a], "after the swap-out and end_step")}


@swap.check(2, "swap_out(seq, count) moves only the last count blocks; the host ids go *before* seq.host_blocks, "
               "because the blocks still on the device hold earlier positions than those already on the host")
def swaps_out_the_tail(cls, rng: random.Random) -> dict:
    bm, a = scene(cls, rng.randint(4 * BS + 1, 8 * BS), gpu=24, cpu=24)
    device = list(a.block_table.blocks)
    first, second = rng.randint(1, len(device) - 3), rng.randint(1, 2)
    seen, names = {}, {}
    for k, count in enumerate((first, second)):
        moves = step(bm, lambda: bm.swap_out(a, count))[0].swap_out
        names.update({h: f"host copy {i} of swap-out {k}" for i, (_, h) in enumerate(moves)})
        seen[f"swap-out {k}, swap_out(seq, {count}) of {len(device)} blocks: table positions copied, then the "
             f"positions kept"] = [positions([d for d, _ in moves], device), positions(a.block_table.blocks, device)]
    return {**seen, "seq.host_blocks after both": [names.get(h, "a block no move wrote") for h in a.host_blocks],
            "num_computed_tokens after both": a.num_computed_tokens, **counts(bm, [a], "after both swap-outs")}


@swap.check(2, "swap_in(seq) takes a new device block (self.take()) for each host block, in order, appends it to "
               "the table, plans copy_in(host, device), and empties seq.host_blocks")
def swaps_in_in_table_order(cls, rng: random.Random) -> dict:
    bm, a = scene(cls, rng.randint(2 * BS + 1, 6 * BS))
    on_host_by_hand(bm, a, count := rng.randint(2, len(a.block_table)))
    hosts, kept = list(a.host_blocks), list(a.block_table.blocks)
    moves = step(bm, lambda: bm.swap_in(a))[0].swap_in
    return {f"{count} host blocks swapped in: their order in moves.swap_in": positions([h for h, _ in moves], hosts),
            "the table after: positions in the kept blocks, then in the moves' device blocks": [
                positions(a.block_table.blocks, kept), positions(a.block_table.blocks, [d for _, d in moves])],
            "seq.host_blocks after": list(a.host_blocks), "num_computed_tokens after": a.num_computed_tokens,
            **counts(bm, [a], "after the swap-in and end_step")}


@swap.check(2, "a block another sequence holds stays with it: release drops only this sequence's reference; the "
               "swapped sequence still gets a host copy of it, and comes back with its own blocks")
def keeps_shared_blocks_with_their_other_holders(cls, rng: random.Random) -> dict:
    bm, parent = scene(cls, rng.randint(BS + 1, 5 * BS))
    bm.fork(parent, child := parent.spawn_sample(1))  # the child's table holds the parent's blocks
    shared = list(parent.block_table.blocks)
    moves = step(bm, lambda: bm.swap_out(child))[0].swap_out
    seen = {f"a sample sharing {len(shared)} blocks swapped out: the parent's table unchanged":
            parent.block_table.blocks == shared, "the blocks copied": positions([d for d, _ in moves], shared),
            "the sample's device, host blocks": [len(child.block_table), len(child.host_blocks)],
            **counts(bm, [parent, child], "after swapping out the sample")}
    step(bm, lambda: bm.swap_in(child))
    counts(bm, [parent, child], "after swapping the sample back in")
    return {**seen, "the sample's device, host blocks, swapped in": [len(child.block_table), len(child.host_blocks)]}


@swap.check(1, "a host block that this step's swap-out writes must not be reused before the copy runs: plan the "
               "copy with self.copy_out, which holds the host block until end_step")
def holds_the_host_blocks_it_writes(cls, rng: random.Random) -> dict:
    a_blocks = rng.randint(2, 6)
    bm, a = scene(cls, a_blocks * BS - rng.randrange(BS), cpu=a_blocks)  # exactly room for a
    # kvlib's own drop: the same step gives up a's host copies (a recompute after all)
    free = step(bm, lambda: (bm.swap_out(a), _block_manager().drop(bm, a), bm.host_pool.num_free)[-1])[1]
    return {f"host blocks free after a's swap-out of {a_blocks} blocks and a drop in the same step": free,
            "host blocks free after end_step": bm.host_pool.num_free}


@swap.check(1, "the copy back reads the host block in the step's last phase, after device-to-host copies: plan "
               "it with self.copy_in, which holds the host block, before you release it")
def holds_the_host_blocks_it_reads(cls, rng: random.Random) -> dict:
    bm, a = scene(cls, (count := rng.randint(2, 5)) * BS + rng.randrange(BS), cpu=count)
    on_host_by_hand(bm, a, count)
    hosts = list(a.host_blocks)
    held = step(bm, lambda: (bm.swap_in(a), sum(1 for h in hosts if bm.host_pool.ref_count(h) > 0))[-1])[1]
    return {f"of {count} host blocks swapped in, those still held before end_step": held,
            "host blocks free after end_step": bm.host_pool.num_free}


@swap.check(2, "host_blocks_needed(seqs, count) is exactly how many host blocks swap_out of each of seqs (its last "
               "count blocks, None: all) allocates, whatever is already on the host; the scheduler makes that room")
def counts_the_host_blocks_a_swap_needs(cls, rng: random.Random) -> dict:
    bm, a, b, c = scene(cls, rng.randint(3, 4) * BS + rng.randint(1, BS - 1),  # a's last block partly filled
                        rng.randint(1, 3) * BS, rng.randint(4 * BS, 6 * BS), gpu=32, cpu=48)
    on_host_by_hand(bm, c, rng.randint(1, 2))  # c is already partly on the host
    seen = {}
    for seqs, count in (([a], None), ([a], 1), ([a, b], None), ([b], len(b.block_table)), ([c], None), ([a, c], 2)):
        seen[f"host_blocks_needed for {[f'{len(s.block_table)} device + {len(s.host_blocks)} host' for s in seqs]} "
             f"blocks, count={count}"] = bm.host_blocks_needed(seqs, count)
    bm.fork(b, child := b.spawn_sample(1))
    for seq, count in ((a, rng.randint(1, 3)), (child, None), (c, None)):
        needed, free = bm.host_blocks_needed([seq], count), bm.host_pool.num_free
        step(bm, lambda: bm.swap_out(seq, count))
        expect(free - bm.host_pool.num_free == needed, f"host_blocks_needed([seq], {count}) said {needed}, but swap_out("
                                                 f"seq, {count}) then took {free - bm.host_pool.num_free} host blocks")
    return seen


# ---- drop ----------------------------------------------------------------------------------------
@drop.check(2, "drop(seq, count) releases the last count device blocks (None: all) and returns the computed tokens "
               "lost: num_computed_tokens before minus after (release shrinks it to what the remaining blocks hold)")
def returns_the_computed_tokens_lost(cls, rng: random.Random) -> dict:
    bm, seen = scene(cls, gpu=24)[0], {}
    for name, n, computed, count in (("a", rng.randint(2 * BS + 1, 4 * BS - 1), None, 1), ("b", 3 * BS, None, None),
                                     ("c", rng.randint(3 * BS, 5 * BS), rng.randint(2 * BS + 1, 3 * BS - 1), 2)):
        seq = sequence(bm, name, n, computed)
        before = [len(seq.block_table), seq.num_computed_tokens]
        seen[f"drop(seq, {count}) of {before[0]} blocks, {before[1]} of {n} tokens computed: returned, computed left, "
             f"blocks left"] = [step(bm, lambda: bm.drop(seq, count))[1], seq.num_computed_tokens, len(seq.block_table)]
    return {**seen, "device blocks free at the end": bm.device_pool.num_free}


@drop.check(2, "drop also lets go of every host copy (release_host each) and empties seq.host_blocks, before "
               "releasing device blocks: release counts the host blocks as computed tokens kept")
def lets_go_of_host_copies(cls, rng: random.Random) -> dict:
    bm, a = scene(cls, rng.randint(3 * BS + 1, 6 * BS))
    on_host = rng.randint(1, len(a.block_table) - 2)
    step(bm, lambda: _block_manager().swap_out(bm, a, on_host))  # kvlib's own swap-out
    shape = [len(a.block_table), len(a.host_blocks), a.num_computed_tokens]
    got = step(bm, lambda: bm.drop(a, 1))[1]
    return {f"drop(seq, 1) of {shape[0]} device and {shape[1]} host blocks, {shape[2]} tokens computed: returned": got,
            "host blocks listed after": len(a.host_blocks), "device blocks, computed tokens left": [
                len(a.block_table), a.num_computed_tokens], **counts(bm, [a], "after the drop")}


@drop.check(1, "dropping a sample that shares its blocks leaves them to the others: one reference each, released")
def keeps_shared_blocks(cls, rng: random.Random) -> dict:
    bm, parent = scene(cls, rng.randint(BS + 1, 5 * BS))
    bm.fork(parent, child := parent.spawn_sample(1))
    got = step(bm, lambda: bm.drop(child))[1]
    return {f"dropping a sample sharing {len(parent.block_table)} blocks ({parent.num_computed_tokens} tokens): "
            f"returned": got, "blocks left to the sample, to its parent": [len(child.block_table),
                                                                              len(parent.block_table)],
            **counts(bm, [parent, child], "after dropping the sample")}


# ---- engine --------------------------------------------------------------------------------------
# Six requests of up to 7 blocks in a pool of 12: preempted again and again. Partial: five requests share a
# 12-token system prompt (prefix caching), two ask for 2 samples, a 16-token budget chunks the prefills.
BASE = dict(block_size=4, num_gpu_blocks=12, max_num_batched_tokens=64, watermark=0.0)
WORKLOADS = {  # check: points, config, the counters observed, hint
    "swaps_whole_sequences": (2, dict(BASE, num_cpu_blocks=48, preemption_mode="swap"), (
        "num_swapped_out_blocks", "num_swapped_in_blocks"), "pass the swap checks first; a sequence swapped out whole "
        "must come back with the same K/V in the same order, and every block that goes out comes back in"),
    "recomputes": (2, dict(BASE, preemption_mode="recompute"), ("num_recomputed_tokens",), "pass the drop checks "
                   "first; a recomputed sequence resumes from the tokens its remaining blocks hold, and "
                   "metrics.num_recomputed_tokens adds up what drop returns"),
    "swaps_partial_tails_of_shared_sequences": (2, dict(
        BASE, num_gpu_blocks=20, num_cpu_blocks=64, preemption_mode="swap", partial_preemption=True,
        enable_prefix_caching=True, max_num_batched_tokens=16), (), "partial preemption swaps only a victim's unique "
        "tail, in steps: host blocks added later hold earlier positions, and shared blocks stay on the device"),
    "falls_back_when_the_host_is_full": (1, dict(BASE, num_cpu_blocks=5, preemption_mode="swap"), (
        "num_swap_fallbacks",), "when the host pool has no room for a swap-out, the engine recomputes instead; it "
        "asks host_blocks_needed first, so that count must be what swap_out will take")}
MAX_STEPS = 500


def _serve(cls, rng: random.Random, check: str) -> dict:
    _, config, counters, _ = WORKLOADS[check]
    system = random_tokens(rng, 12 if config.get("partial_preemption") else 0)
    prompts = [system + random_tokens(rng, 2 + 3 * i if system else 6 + 3 * i) for i in range(5 if system else 6)]
    params = [SamplingParams(max_tokens=16 if system else 10, n=2 if system and i in (1, 3) else 1, ignore_eos=True)
              for i in range(len(prompts))]
    llm = LLM("default", EngineConfig(device="cpu", **config), block_manager=cls, verbose=False)
    outputs = serve_checked(llm, prompts, params, MAX_STEPS)
    return {**{f"request {i}: tokens of each sample": [s.token_ids for s in o.samples] for i, o in enumerate(outputs)},
            **{f"metrics.{name} over the run": getattr(llm.metrics, name) for name in counters}}


for _name, (_points, _, _, _hint) in WORKLOADS.items():
    engine.add(_name, _points, _hint, partial(_serve, check=_name))
