"""Lab 06 checks: the learner's preemption mechanisms, on a bare block manager and in the engine.

The learner writes a :class:`~kvlib.block_manager.BlockManager` subclass's ``swap_out``,
``swap_in``, ``drop`` and ``host_blocks_needed`` (see ``kvlib.interfaces.PreemptionMechanism``).
The unit checks build a block manager from the learner's class on kvlib's allocators, act on
hand-made sequences, one rule per check, and read the moves and reference counts it leaves; a
check of one method sets up its scene with kvlib's own versions of the others. The engine checks
plug the class in with ``LLM(..., block_manager=...)``, serve workloads that swap whole
sequences, recompute, preempt partially with shared blocks, and run out of host room, check the
block bookkeeping after every step, and compare the tokens with a run that never preempts and the
counters with kvlib's own block manager.
"""
from __future__ import annotations

from collections import Counter
from functools import cache

from kvlib.block_allocator import BlockAllocator
from kvlib.block_manager import BlockManager
from kvlib.config import SamplingParams
from kvlib.course.grading.checks import Task, expect
from kvlib.course.grading.extract import Rules
from kvlib.course.grading.guards import own_work
from kvlib.course.grading.results import TaskResult
from kvlib.course.grading.serving import serve_checked
from kvlib.sequence import Sequence

GRADED = ("swap_out", "swap_in", "drop", "host_blocks_needed")
IMPORTS = {"kvlib.block_manager": {"BlockManager"}, "kvlib.sequence": {"Sequence"}}
swap = Task("swap", Rules(needs=("MyBlockManager",), kvlib_imports=IMPORTS,
                          own_methods=("swap_out", "swap_in", "host_blocks_needed")))
drop = Task("drop", Rules(needs=("MyBlockManager",), kvlib_imports=IMPORTS, own_methods=("drop",)))
engine = Task("engine", Rules(needs=("MyBlockManager",), kvlib_imports=IMPORTS, own_methods=GRADED))
TASKS = [swap, drop, engine]

# kvlib's own versions, to set up the scene of a check of another method (taken before any check runs).
REFERENCE_SWAP_OUT = BlockManager.swap_out
REFERENCE_DROP = BlockManager.drop

BS = 4


def check_swap(block_manager_cls) -> TaskResult:
    return swap.grade(block_manager_cls)


def check_drop(block_manager_cls) -> TaskResult:
    return drop.grade(block_manager_cls)


def check_engine(block_manager_cls) -> TaskResult:
    return engine.grade(block_manager_cls)


def graded(check):
    """Run a unit check with kvlib's own versions of the graded methods refused."""
    def run(cls) -> None:
        with own_work(BlockManager, GRADED, cls):
            check(cls)
    run.__name__ = check.__name__
    return run


# ---- the scene -----------------------------------------------------------------------------------
def manager(cls, gpu: int = 16, cpu: int = 16) -> BlockManager:
    return cls(BS, BlockAllocator(gpu), BlockAllocator(cpu))


def sequence(bm: BlockManager, name: str, num_tokens: int, computed=None) -> Sequence:
    """A sequence of ``num_tokens`` tokens holding their blocks, ``computed`` of them (default all) in the cache."""
    seq = Sequence(name, list(range(100, 100 + num_tokens)), SamplingParams(), BS, 0.0)
    bm.begin_step()
    bm.grow(seq, num_tokens)
    bm.end_step()
    seq.num_computed_tokens = seq.peak_computed_tokens = num_tokens if computed is None else computed
    return seq


def fork(bm: BlockManager, parent: Sequence) -> Sequence:
    child = parent.spawn_sample(1)
    bm.fork(parent, child)
    return child


def _expect_counts(bm: BlockManager, seqs: list[Sequence], where: str) -> None:
    """Reference counts equal the tables (device) and host lists that hold each block, nothing else."""
    for name, pool, owners in (("device", bm.gpu, Counter(b for s in seqs for b in s.block_table.blocks)),
                               ("host", bm.cpu, Counter(b for s in seqs for b in s.host_blocks))):
        for block in range(pool.num_blocks):
            expect(pool.ref_count(block) == owners[block],
                   f"{where}: {name} block {block} has reference count {pool.ref_count(block)} but {owners[block]} "
                   f"sequence(s) hold it")


# ---- swap ----------------------------------------------------------------------------------------
@swap.check(2, "swap_out(seq) adds one (device, host) pair per block to self.moves.swap_out, in table order, "
               "lists the host blocks in seq.host_blocks and lets go of the device blocks with release; the "
               "computed tokens stay (their K/V is on the host)")
@graded
def swaps_out_a_whole_sequence(cls) -> None:
    bm = manager(cls)
    a = sequence(bm, "a", 10)  # 3 blocks, the last holding 2 tokens
    device = list(a.block_table.blocks)
    bm.begin_step()
    bm.swap_out(a)
    moves = bm.end_step().swap_out
    expect([d for d, _ in moves] == device,
           f"swapping out a sequence holding device blocks {device} gave moves.swap_out {moves}; expected one "
           f"(device, host) pair per block, in table order")
    hosts = [h for _, h in moves]
    expect(a.host_blocks == hosts, f"after the swap-out, seq.host_blocks is {a.host_blocks}; expected the hosts of "
                                   f"the moves, in order: {hosts}")
    expect(a.block_table.blocks == [] and bm.gpu.num_free == 16,
           f"after the swap-out, the sequence's table is {a.block_table.blocks} and {bm.gpu.num_free} of 16 device "
           f"blocks are free; expected an empty table and every device block free")
    expect(a.num_computed_tokens == 10, f"after the swap-out, num_computed_tokens is {a.num_computed_tokens}; "
                                        f"expected 10: the host copies hold them")
    _expect_counts(bm, [a], "after the swap-out and end_step")


@swap.check(2, "swap_out(seq, count) moves only the last count blocks; the host ids go *before* seq.host_blocks, "
               "because the blocks still on the device hold earlier positions than those already on the host")
@graded
def swaps_out_the_tail(cls) -> None:
    bm = manager(cls)
    a = sequence(bm, "a", 14)  # 4 blocks
    device = list(a.block_table.blocks)
    bm.begin_step()
    bm.swap_out(a, 2)
    moves = bm.end_step().swap_out
    expect([d for d, _ in moves] == device[2:] and a.block_table.blocks == device[:2],
           f"swap_out(seq, 2) on device blocks {device} gave moves {moves} and left the table {a.block_table.blocks}; "
           f"expected the last 2 blocks moved, {device[:2]} kept")
    tail = [h for _, h in moves]
    expect(a.host_blocks == tail, f"after swap_out(seq, 2), seq.host_blocks is {a.host_blocks}; expected {tail}")
    bm.begin_step()
    bm.swap_out(a, 1)
    moves = bm.end_step().swap_out
    expect([d for d, _ in moves] == device[1:2], f"a second swap_out(seq, 1) on the table {device[:2]} gave moves "
                                                 f"{moves}; expected block {device[1]} moved")
    expected = [h for _, h in moves] + tail
    expect(a.host_blocks == expected,
           f"after a second swap_out(seq, 1), seq.host_blocks is {a.host_blocks}; expected {expected}: the block just "
           f"moved holds positions 4-7, before those already on the host (8-13)")
    expect(a.num_computed_tokens == 14, f"num_computed_tokens became {a.num_computed_tokens}; expected 14 to stay")
    _expect_counts(bm, [a], "after both swap-outs")


@swap.check(2, "swap_in(seq) takes a new device block (self.take()) for each host block, in order, appends it to "
               "the table, adds (host, device) to self.moves.swap_in, and empties seq.host_blocks")
@graded
def swaps_in_in_table_order(cls) -> None:
    bm = manager(cls)
    a = sequence(bm, "a", 14)  # 4 blocks; kvlib's swap_out puts the last 3 on the host
    kept = a.block_table.blocks[0]
    bm.begin_step()
    REFERENCE_SWAP_OUT(bm, a, 3)
    bm.end_step()
    hosts = list(a.host_blocks)
    bm.begin_step()
    bm.swap_in(a)
    moves = bm.end_step().swap_in
    expect([h for h, _ in moves] == hosts,
           f"swapping in host blocks {hosts} gave moves.swap_in {moves}; expected one (host, device) pair per host "
           f"block, in order")
    expect(a.block_table.blocks == [kept] + [d for _, d in moves],
           f"after the swap-in the table is {a.block_table.blocks}; expected block {kept} (still on the device) "
           f"followed by the new blocks in the order of the moves, {[d for _, d in moves]}")
    expect(a.host_blocks == [], f"after the swap-in, seq.host_blocks is {a.host_blocks}; expected []")
    expect(a.num_computed_tokens == 14, f"num_computed_tokens became {a.num_computed_tokens}; expected 14 to stay")
    _expect_counts(bm, [a], "after the swap-in and end_step")
    expect(bm.cpu.num_free == 16, f"after the swap-in and end_step, {bm.cpu.num_free} of 16 host blocks are free; "
                                  f"expected all of them")


@swap.check(2, "a block another sequence holds stays with it: release drops only this sequence's reference; the "
               "swapped sequence still gets a host copy of it, and comes back with its own blocks")
@graded
def keeps_shared_blocks_with_their_other_holders(cls) -> None:
    bm = manager(cls)
    parent = sequence(bm, "p", 10)
    child = fork(bm, parent)  # the child's table holds the parent's 3 blocks
    shared = list(parent.block_table.blocks)
    bm.begin_step()
    bm.swap_out(child)
    moves = bm.end_step().swap_out
    expect(parent.block_table.blocks == shared and child.block_table.blocks == [] and len(child.host_blocks) == 3,
           f"swapping out a sample that shares blocks {shared} with its parent left the parent "
           f"{parent.block_table.blocks}, the sample {child.block_table.blocks} on the device and {child.host_blocks} on the host; expected the "
           f"parent unchanged and the sample's 3 blocks on the host")
    expect([d for d, _ in moves] == shared, f"moves.swap_out is {moves}; expected a copy of each of {shared}")
    _expect_counts(bm, [parent, child], "after swapping out the sample")
    bm.begin_step()
    bm.swap_in(child)
    bm.end_step()
    expect(len(child.block_table) == 3 and child.host_blocks == [],
           f"after the swap-in the sample holds {child.block_table.blocks} on the device and {child.host_blocks} on "
           f"the host; expected 3 device blocks and none on the host")
    _expect_counts(bm, [parent, child], "after swapping the sample back in")


@swap.check(1, "a host block that this step's swap-out writes must not be reused before the copy runs: hold it "
               "(self.hold_host) when you allocate it; end_step lets go of the hold")
@graded
def holds_the_host_blocks_it_writes(cls) -> None:
    bm = manager(cls, cpu=3)
    a = sequence(bm, "a", 10)
    bm.begin_step()
    bm.swap_out(a)
    hosts = list(a.host_blocks)
    REFERENCE_DROP(bm, a)  # the same step gives up a's host copies (a recompute after all)
    expect(bm.cpu.num_free == 0,
           f"a was swapped out to host blocks {hosts} and dropped in the same step, and {bm.cpu.num_free} host "
           f"block(s) are now free: another action of this step could take one and the swap-out's copy would write into it "
           f"too; they must stay held until end_step")
    bm.end_step()
    expect(bm.cpu.num_free == 3, f"after end_step, {bm.cpu.num_free} of 3 host blocks are free; expected all of them")


@swap.check(1, "the copy back reads the host block in the step's last phase, after device-to-host copies: hold "
               "it (self.hold_host) before you free it, so nothing else this step can write into it")
@graded
def holds_the_host_blocks_it_reads(cls) -> None:
    bm = manager(cls, cpu=3)
    a = sequence(bm, "a", 10)
    bm.begin_step()
    REFERENCE_SWAP_OUT(bm, a)
    bm.end_step()
    hosts = list(a.host_blocks)
    bm.begin_step()
    bm.swap_in(a)
    expect(all(bm.cpu.ref_count(h) > 0 for h in hosts),
           f"right after swap_in, before end_step, host blocks {[h for h in hosts if bm.cpu.ref_count(h) == 0]} are "
           f"free: this step's copies back still read them, and a demotion to the host tier in the same step could "
           f"write into them first")
    bm.end_step()
    expect(bm.cpu.num_free == 3, f"after end_step, {bm.cpu.num_free} of 3 host blocks are free; expected all of them")


@swap.check(2, "host_blocks_needed(seqs, count) is exactly how many host blocks swap_out of each of seqs (its last "
               "count blocks, None: all) allocates; the scheduler makes that much host room first")
@graded
def counts_the_host_blocks_a_swap_needs(cls) -> None:
    bm = manager(cls, cpu=32)
    a, b = sequence(bm, "a", 14), sequence(bm, "b", 6)  # 4 and 2 blocks
    for seqs, count, want in (([a], None, 4), ([a], 1, 1), ([a, b], None, 6), ([b], 2, 2)):
        got = bm.host_blocks_needed(seqs, count)
        expect(got == want, f"host_blocks_needed for sequences of {[len(s.block_table) for s in seqs]} device blocks, "
                            f"count={count}, is {got}; expected {want}")
    child = fork(bm, b)
    for seq, count in ((a, 3), (child, None)):
        needed, free = bm.host_blocks_needed([seq], count), bm.cpu.num_free
        bm.begin_step()
        bm.swap_out(seq, count)
        bm.end_step()
        expect(free - bm.cpu.num_free == needed,
               f"host_blocks_needed([seq], {count}) said {needed}, but swap_out(seq, {count}) then took "
               f"{free - bm.cpu.num_free} host blocks")


# ---- drop ----------------------------------------------------------------------------------------
@drop.check(2, "drop(seq, count) releases the last count device blocks (None: all) and returns the computed tokens "
               "lost: num_computed_tokens before minus after (release shrinks it to what the remaining blocks hold)")
@graded
def returns_the_computed_tokens_lost(cls) -> None:
    bm = manager(cls)
    a = sequence(bm, "a", 10)  # 3 blocks, the last holding 2 tokens
    for count, lost, left in ((1, 2, 8), (None, 8, 0)):
        blocks = len(a.block_table)
        bm.begin_step()
        got = bm.drop(a, count)
        bm.end_step()
        expect(got == lost and a.num_computed_tokens == left,
               f"drop(seq, {count}) on {blocks} blocks holding {left + lost} computed tokens returned {got} and left "
               f"{a.num_computed_tokens} computed; expected {lost} lost and {left} left")
    expect(a.block_table.blocks == [] and bm.gpu.num_free == 16,
           f"after drop(seq), the table is {a.block_table.blocks} and {bm.gpu.num_free} of 16 device blocks are free")
    b = sequence(bm, "b", 12, computed=9)  # 3 blocks, 9 tokens computed so far (a prefill chunk)
    bm.begin_step()
    got = bm.drop(b, 2)
    bm.end_step()
    expect(got == 5 and b.num_computed_tokens == 4,
           f"drop(seq, 2) on 3 blocks with 9 of 12 tokens computed returned {got} and left {b.num_computed_tokens}; "
           f"expected 5 lost (positions 4-8) and 4 left")


@drop.check(2, "drop also lets go of every host copy (free_host each) and empties seq.host_blocks, before "
               "releasing device blocks: release counts the host blocks as computed tokens kept")
@graded
def lets_go_of_host_copies(cls) -> None:
    bm = manager(cls)
    a = sequence(bm, "a", 14)  # 4 blocks; kvlib's swap_out puts the last 2 on the host
    bm.begin_step()
    REFERENCE_SWAP_OUT(bm, a, 2)
    bm.end_step()
    bm.begin_step()
    got = bm.drop(a, 1)
    bm.end_step()
    expect(a.host_blocks == [] and bm.cpu.num_free == 16,
           f"after drop, seq.host_blocks is {a.host_blocks} and {bm.cpu.num_free} of 16 host blocks are free; "
           f"expected no host block left")
    expect(len(a.block_table) == 1 and got == 10 and a.num_computed_tokens == 4,
           f"drop(seq, 1) on a sequence with 2 device blocks and 2 host blocks (14 computed tokens) returned {got}, "
           f"left {len(a.block_table)} device block(s) and {a.num_computed_tokens} computed tokens; expected 10 lost, "
           f"1 block and 4 tokens left")
    _expect_counts(bm, [a], "after the drop")


@drop.check(1, "dropping a sample that shares its blocks leaves them to the others: one reference each, released")
@graded
def keeps_shared_blocks(cls) -> None:
    bm = manager(cls)
    parent = sequence(bm, "p", 10)
    child = fork(bm, parent)
    bm.begin_step()
    got = bm.drop(child)
    bm.end_step()
    expect(got == 10 and child.block_table.blocks == [] and len(parent.block_table) == 3,
           f"dropping a sample that shares 3 blocks returned {got}, left it {child.block_table.blocks} and its parent "
           f"{parent.block_table.blocks}; expected 10 lost, nothing left to the sample, the parent's 3 blocks intact")
    _expect_counts(bm, [parent, child], "after dropping the sample")


# ---- engine --------------------------------------------------------------------------------------
# Six requests needing up to 7 blocks each in a pool of 12 blocks of 4 tokens: the newest is
# preempted again and again (whole sequences).
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(6 + 3 * i)] for i in range(6)]
PARAMS = [SamplingParams(max_tokens=10, ignore_eos=True)] * 6
BASE = dict(block_size=4, num_gpu_blocks=12, max_num_batched_tokens=64, watermark=0.0)
# Partial preemption with shared blocks: a 12-token system prompt shared through prefix caching,
# two requests with 2 samples, a 16-token budget that chunks the prefills.
SYSTEM = [(11 * j) % 250 + 3 for j in range(12)]
SHARED_PROMPTS = [SYSTEM + [(5 * i + j) % 250 + 3 for j in range(2 + 3 * i)] for i in range(5)]
SHARED_PARAMS = [SamplingParams(max_tokens=16, n=2 if i in (1, 3) else 1, ignore_eos=True) for i in range(5)]
WORKLOADS = {
    "swap": (dict(BASE, num_cpu_blocks=48, preemption_mode="swap"), PROMPTS, PARAMS),
    "recompute": (dict(BASE, preemption_mode="recompute"), PROMPTS, PARAMS),
    "partial": (dict(block_size=4, num_gpu_blocks=20, num_cpu_blocks=64, preemption_mode="swap",
                     partial_preemption=True, enable_prefix_caching=True, max_num_batched_tokens=16, watermark=0.0),
                SHARED_PROMPTS, SHARED_PARAMS),
    "small_host": (dict(BASE, num_cpu_blocks=5, preemption_mode="swap"), PROMPTS, PARAMS),
}
MAX_STEPS = 500


@engine.check(2, "pass the swap checks first; a sequence swapped out whole must come back with the same K/V in the "
                 "same order, and every block that goes out comes back in")
def swaps_whole_sequences(cls) -> None:
    mine = _expect_same_tokens(cls, "swap")
    reference = _reference("swap")[1]
    expect(mine["swapped_out"] == mine["swapped_in"] == reference["swapped_out"],
           f"your run swapped {mine['swapped_out']} blocks out and {mine['swapped_in']} in; kvlib's swapped "
           f"{reference['swapped_out']} each way (one sample per request: every block out comes back in)")


@engine.check(2, "pass the drop checks first; a recomputed sequence resumes from the tokens its remaining blocks "
                 "hold, and metrics.num_recomputed_tokens adds up what drop returns")
def recomputes(cls) -> None:
    mine = _expect_same_tokens(cls, "recompute")
    reference = _reference("recompute")[1]
    expect(mine["recomputed"] == reference["recomputed"],
           f"your drop reported {mine['recomputed']} computed tokens lost over the run; kvlib's "
           f"{reference['recomputed']}")


@engine.check(2, "partial preemption swaps only a victim's unique tail, in steps: host blocks added later hold "
                 "earlier positions, and blocks shared with other samples or the prefix cache stay on the device")
def swaps_partial_tails_of_shared_sequences(cls) -> None:
    _expect_same_tokens(cls, "partial")


@engine.check(1, "when the host pool has no room for a swap-out, the engine recomputes instead; it asks "
                 "host_blocks_needed first, so that count must be what swap_out will take")
def falls_back_when_the_host_is_full(cls) -> None:
    mine = _expect_same_tokens(cls, "small_host")
    reference = _reference("small_host")[1]
    expect(mine["fallbacks"] == reference["fallbacks"],
           f"{mine['fallbacks']} swaps fell back to recompute for lack of host room in your run, "
           f"{reference['fallbacks']} in kvlib's")


def _expect_same_tokens(cls, workload: str) -> dict:
    expected = _unpressured(workload)
    with own_work(BlockManager, GRADED, cls):
        tokens, counters = _serve(cls, workload)
    for i, (got, want) in enumerate(zip(tokens, expected)):
        expect(got == want, f"request {i} generated {got} with your block manager but {want} in a pool with room "
                            f"({counters['preemptions']} preemptions in your run)")
    return counters


@cache
def _unpressured(workload: str) -> tuple:
    config, prompts, params = WORKLOADS[workload]
    roomy = dict(config, num_gpu_blocks=256, preemption_mode="recompute", partial_preemption=False)
    return tuple(_serve(BlockManager, workload, roomy)[0])


@cache
def _reference(workload: str) -> tuple:
    return _serve(BlockManager, workload)


def _serve(cls, workload: str, config=None) -> tuple[list, dict]:
    from kvlib import LLM, EngineConfig

    default, prompts, params = WORKLOADS[workload]
    llm = LLM("default", EngineConfig(device="cpu", **(config or default)), block_manager=cls, verbose=False)
    outputs = serve_checked(llm, prompts, params, MAX_STEPS)
    m = llm.metrics
    return ([[s.token_ids for s in out.samples] for out in outputs],
            dict(preemptions=m.num_preemptions, swapped_out=m.num_swapped_out_blocks,
                 swapped_in=m.num_swapped_in_blocks, recomputed=m.num_recomputed_tokens,
                 fallbacks=m.num_swap_fallbacks))
