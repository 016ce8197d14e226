"""The block manager on its own: no model, no scheduler, exact block counts after each action."""
import pytest

from kvlib.config import SamplingParams
from kvlib.core.block_allocator import BlockAllocator
from kvlib.core.block_manager import BlockManager
from kvlib.core.prefix_cache import HostPrefixTier
from kvlib.core.sequence import Sequence

BS = 4


def manager(gpu=16, cpu=16, **extra) -> BlockManager:
    return BlockManager(BS, BlockAllocator(gpu), BlockAllocator(cpu), **extra)


def sequence(num_tokens: int, computed: int = 0, n: int = 1) -> Sequence:
    seq = Sequence("r", list(range(100, 100 + num_tokens)), SamplingParams(n=n), BS, 0.0)
    seq.num_computed_tokens = computed
    return seq


def computed(seq: Sequence, end: int) -> None:
    """What a model step leaves behind: tokens up to ``end`` computed."""
    seq.num_computed_tokens = seq.peak_computed_tokens = end


def test_grow_takes_the_missing_blocks_only():
    bm, seq = manager(), sequence(10)
    assert bm.blocks_to_grow(seq, 10) == 3 and bm.shortfall(seq, 10) == 0
    bm.grow(seq, 10)
    computed(seq, 10)
    assert len(seq.block_table) == 3 and bm.device_pool.num_free == 13
    seq.output_token_ids += [1, 2]  # 12 tokens: still 3 blocks, then 13 needs a fourth
    assert bm.blocks_to_grow(seq, 12) == 0 and bm.blocks_to_grow(seq, 13) == 1
    bm.grow(seq, 12)
    assert bm.device_pool.num_free == 13 and not bm.end_step()


def test_admission_keeps_the_watermark_unless_asked_not_to():
    bm, seq = manager(gpu=10, watermark_blocks=2), sequence(32)  # 8 blocks
    assert bm.can_admit(seq, [], 32, use_watermark=True)
    assert not bm.can_admit(sequence(36), [], 36, use_watermark=True)  # 9 blocks would leave 1 < 2 free
    assert bm.can_admit(sequence(36), [], 36, use_watermark=False)  # alone in the pool it may use all of it


def test_a_fork_shares_and_the_first_write_copies():
    bm, parent = manager(), sequence(6)
    bm.grow(parent, 6)
    computed(parent, 6)
    child = parent.spawn_sample(1)
    bm.fork(parent, child)
    assert child.block_table.blocks == parent.block_table.blocks
    assert [bm.device_pool.ref_count(b) for b in parent.block_table.blocks] == [2, 2]
    shared_tail = parent.block_table.blocks[1]
    parent.output_token_ids.append(7)  # position 6 lands in the shared, partly filled block 1
    assert bm.blocks_to_grow(parent, 7) == 1
    bm.grow(parent, 7)
    moves = bm.end_step()
    new_tail = parent.block_table.blocks[1]
    assert moves.copies == [(shared_tail, new_tail)] and new_tail != shared_tail
    assert child.block_table.blocks[1] == shared_tail and bm.device_pool.ref_count(shared_tail) == 1
    assert bm.unique_tail(parent) == 1 and bm.unique_tail(child) == 1 and bm.num_shared(child) == 1


def test_swap_out_moves_a_shared_full_block_once():
    bm, parent = manager(), sequence(9)
    bm.grow(parent, 9)
    computed(parent, 9)  # blocks 0 and 1 full, block 2 holds one token
    child = parent.spawn_sample(1)
    bm.fork(parent, child)
    bm.begin_step()
    bm.swap_out(parent)
    assert len(bm.moves.swap_out) == 3 and bm.device_pool.num_free == 16 - 3  # the child still holds all three
    bm.end_step()
    bm.begin_step()  # a later step: the child's full blocks already have host twins
    assert bm.host_blocks_needed([child]) == 1
    bm.swap_out(child)
    moves = bm.end_step()
    assert len(moves.swap_out) == 1 and bm.device_pool.num_free == 16 and bm.host_pool.num_used == 4
    assert child.host_blocks[:2] == parent.host_blocks[:2] and child.host_blocks[2] != parent.host_blocks[2]


def test_samples_come_back_one_by_one_and_share_full_blocks_again():
    bm, parent = manager(), sequence(9)
    bm.grow(parent, 9)
    computed(parent, 9)
    child = parent.spawn_sample(1)
    bm.fork(parent, child)
    bm.begin_step()
    bm.swap_out(parent)
    bm.swap_out(child)  # in the same step: every block they share moves once, the partly filled one too
    bm.end_step()
    assert bm.host_pool.num_used == 3 and bm.device_pool.num_free == 16
    bm.begin_step()
    assert bm.can_swap_in(parent, 10, use_watermark=False)
    bm.swap_in(parent)
    first = bm.end_step()
    assert len(first.swap_in) == 3 and not parent.host_blocks
    bm.begin_step()
    bm.swap_in(child)  # its two full blocks have device twins: shared, not copied; the partial one is copied
    second = bm.end_step()
    assert len(second.swap_in) == 1
    assert child.block_table.blocks[:2] == parent.block_table.blocks[:2]
    assert child.block_table.blocks[2] != parent.block_table.blocks[2]
    assert bm.host_pool.num_used == 0 and bm.device_pool.num_free == 16 - 4


def test_a_host_block_read_this_step_is_not_reused_before_the_copy():
    bm = manager(gpu=8, cpu=2)
    swapped = sequence(8)
    bm.grow(swapped, 8)
    computed(swapped, 8)
    bm.begin_step()
    bm.swap_out(swapped)
    bm.end_step()
    assert bm.host_pool.num_free == 0
    victim = sequence(4)
    bm.grow(victim, 4)
    computed(victim, 4)
    bm.begin_step()
    bm.swap_in(swapped)  # its two host blocks are read this step ...
    assert bm.host_pool.num_free == 0 and not bm.make_host_room(1)  # ... so nobody may write into them yet
    moves = bm.end_step()
    assert len(moves.swap_in) == 2 and bm.host_pool.num_free == 2


def test_drop_lets_go_of_the_tail_and_of_host_copies():
    bm, seq = manager(), sequence(12)
    bm.grow(seq, 12)
    computed(seq, 12)
    assert bm.drop(seq, 1) == 4 and len(seq.block_table) == 2 and seq.num_computed_tokens == 8
    bm.swap_out(seq, 1)  # partial swap: block 1 on the host, block 0 on the device
    assert seq.num_computed_tokens == 8 and len(seq.host_blocks) == 1
    assert bm.drop(seq) == 8 and bm.device_pool.num_free == 16
    bm.end_step()
    assert bm.host_pool.num_free == 16


def test_prefix_blocks_are_named_evicted_tail_first_and_demoted_to_the_host_tier():
    bm = manager(gpu=4, cpu=4, enable_prefix_caching=True, host_prefix_cache=True)
    first = sequence(9)
    bm.grow(first, 9)
    computed(first, 9)
    bm.register_computed(first)
    assert bm.cache.num_cached == 2 and bm.cache.num_evictable == 0
    bm.drop(first)
    assert bm.cache.num_evictable == 2 and bm.num_free_blocks == 4
    other = Sequence("o", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], SamplingParams(), BS, 1.0)
    bm.begin_step()
    assert bm.can_admit(other, [], 13, use_watermark=False)
    bm.grow(other, 13)  # four blocks: the two free ones, then both cached blocks, the tail one first
    moves = bm.end_step()
    assert len(moves.demote) == 2 and bm.cache.num_cached == 0 and bm.host_tier.num_cached == 2
    again = sequence(9)
    hits = bm.prefix_hits(again)
    assert [h.on_host for h in hits] == [True, True]


def other_sequence(first_token: int, num_tokens: int) -> Sequence:
    return Sequence(f"o{first_token}", list(range(first_token, first_token + num_tokens)), SamplingParams(), BS, 1.0)


def released(bm: BlockManager, seq: Sequence) -> Sequence:
    """``seq`` computed, cached and let go: every full block evictable, the tail first."""
    bm.grow(seq, seq.num_tokens)
    computed(seq, seq.num_tokens)
    bm.register_computed(seq)
    bm.drop(seq)
    return seq


def test_a_tier_smaller_than_one_steps_evictions_keeps_the_head_of_the_prefix():
    """A step that evicts a whole conversation into a tier of half its size: the device evicts tail first, so the
    tier was full of the tail when the head came and could drop none of it (its copies were this step's), and a
    returning turn found nothing (lesson 09: a 32-block tier kept blocks 20..51 of 64, 1,032 tokens recomputed)."""
    bm = manager(gpu=4, cpu=2, enable_prefix_caching=True, host_prefix_cache=True)
    released(bm, sequence(16))
    other = other_sequence(500, 16)
    bm.begin_step()
    bm.grow(other, 16)  # takes all four cached blocks
    moves = bm.end_step()
    head = sequence(16)
    assert [h.on_host for h in bm.prefix_hits(head)] == [True, True]  # blocks 0 and 1: the head
    assert len(moves.demote) == 2
    assert sorted(e.tokens[0] for e in bm.host_tier) == [100, 104]
    # They join the tier tail first, so the tier too gives up the end of a prefix before its head.
    assert [e.tokens[0] for e in bm.host_tier] == [104, 100]
    assert bm.host_pool.num_free == 0 and all(bm.host_pool.ref_count(e.block_id) == 1 for e in bm.host_tier)


def test_a_tier_entered_tail_first_gives_up_the_tail_for_a_head_evicted_later():
    """Blocks 3, 2 and 1 evicted in one step into a tier of two, then block 0: the tier keeps 1 and 2, entered 2 first,
    so making room for 0 drops 2 and the prefix 0, 1 is found. Kept in the order they came, the tier held 3 and 2
    and found nothing; entered head first, it would drop 1 for 0 and find block 0 alone."""
    bm = manager(gpu=4, cpu=2, enable_prefix_caching=True, host_prefix_cache=True)
    released(bm, sequence(16))
    for first_token, num_tokens in ((500, 12), (600, 4)):
        bm.begin_step()
        bm.grow(other_sequence(first_token, num_tokens), num_tokens)
        bm.end_step()
    assert [h.on_host for h in bm.prefix_hits(sequence(16))] == [True, True]


def test_a_block_evicted_and_wanted_in_one_step_is_found_on_the_host():
    """A prompt admitted after the step evicted its prefix finds it on the host tier (kept the moment it is wanted,
    copied out and back in the same step), not only from the next step on."""
    bm = manager(gpu=4, cpu=4, enable_prefix_caching=True, host_prefix_cache=True)
    released(bm, sequence(16))
    bm.begin_step()
    other = other_sequence(500, 16)
    bm.grow(other, 16)  # evicts all four
    bm.drop(other)
    returning = sequence(17)
    hits = bm.prefix_hits(returning)
    assert [h.on_host for h in hits] == [True] * 4
    bm.admit(returning, hits)
    moves = bm.end_step()
    written = {host for _, host in moves.demote}
    assert len(moves.demote) == 4 and [host in written for host, _ in moves.promote] == [True] * 4


def test_a_block_the_tier_keeps_already_is_not_dropped_for_a_tail_evicted_with_it():
    """A conversation's head came back from the tier (and is still kept there), then the whole conversation is
    evicted in one step into a full tier: making room for its tail must not drop the head, the tier's least recently
    used blocks (the next turn found nothing)."""
    bm = manager(gpu=4, cpu=3, enable_prefix_caching=True, host_prefix_cache=True)
    released(bm, sequence(16))
    bm.begin_step()
    other = other_sequence(500, 16)
    bm.grow(other, 16)  # evicts all four: the tier keeps blocks 0..2
    bm.end_step()
    bm.drop(other)
    returning = sequence(16)
    bm.begin_step()
    hits = bm.prefix_hits(returning)
    assert [h.on_host for h in hits] == [True] * 3
    bm.admit(returning, hits)
    bm.grow(returning, 16)
    bm.end_step()
    computed(returning, 16)
    bm.register_computed(returning)
    bm.drop(returning)
    bm.begin_step()
    bm.grow(other_sequence(600, 16), 16)  # evicts the conversation's four blocks again; block 3 finds no room
    bm.end_step()
    assert [h.on_host for h in bm.prefix_hits(sequence(16))] == [True] * 3


def test_blocks_evicted_beside_one_the_tier_keeps_already_are_kept_too():
    """One step evicts a two-block prefix and, last, a block whose copy the tier kept already (it came back
    from the host and went again): that block needs no room, and the others still get theirs."""
    bm = manager(gpu=4, cpu=3, enable_prefix_caching=True, host_prefix_cache=True)
    x = released(bm, sequence(4))  # one block
    bm.begin_step()
    filler = other_sequence(500, 16)
    bm.grow(filler, 16)  # evicts x's block: the tier keeps it
    bm.end_step()
    bm.drop(filler)
    released(bm, other_sequence(300, 8))  # y: two blocks evictable, tail first
    x_again = Sequence("x", x.token_ids + [1], SamplingParams(), BS, 0.0)
    bm.begin_step()
    hits = bm.prefix_hits(x_again)
    assert [h.on_host for h in hits] == [True]
    bm.admit(x_again, hits)
    bm.grow(x_again, 5)
    bm.end_step()
    computed(x_again, 5)
    bm.register_computed(x_again)
    bm.drop(x_again)  # x's block evictable after y's
    bm.begin_step()
    bm.grow(other_sequence(600, 16), 16)  # evicts y's two blocks, then x's
    bm.end_step()
    assert [h.on_host for h in bm.prefix_hits(other_sequence(300, 9))] == [True, True]  # y's two blocks
    assert [h.on_host for h in bm.prefix_hits(x_again)] == [True]


@pytest.mark.parametrize("method", ["evict_one", "put", "put after keeping the block"])
def test_a_tier_that_raises_while_the_step_ends_leaves_no_block_held_and_no_move_lost(method):
    """A plugged-in tier raising as the step's evictions join it: the step's holds are let go, the host blocks taken
    for the tier go back, and the step's planned moves (a swap-out here) stay in ``moves`` for the engine to carry
    out, as when a piece raises mid-step. The holds stayed and the scheduler's plan lost every move of the step;
    then, with ``put`` raising, the block taken for it stayed taken by no one."""
    def raising(tier, *args):
        if method == "put after keeping the block":  # the tier owns it now: the engine must not free it
            HostPrefixTier.put(tier, *args)
        raise RuntimeError("a bug in a plugged-in tier")
    Raising = type("Raising", (HostPrefixTier,), {method.split()[0]: raising})
    bm = manager(gpu=8, cpu=2, enable_prefix_caching=True, host_prefix_cache=True, host_tier_factory=Raising)
    released(bm, sequence(16))
    paused = sequence(4)
    bm.grow(paused, 4)
    computed(paused, 4)
    bm.begin_step()
    bm.swap_out(paused)  # takes one of the two host blocks
    bm.grow(other_sequence(500, 32), 32)  # four free device blocks, then the four cached ones
    with pytest.raises(RuntimeError, match="plugged-in tier"):
        bm.end_step()
    kept = [e.block_id for e in bm.host_tier]
    assert len(bm.moves.swap_out) == 1 and [host for _, host in bm.moves.demote] == kept  # a kept block is written
    assert bm.host_pool.ref_count(paused.host_blocks[0]) == 1 and bm.host_pool.num_free == 1 - len(kept)
    assert all(bm.host_pool.ref_count(block) == 1 for block in kept)


def test_a_host_tier_hit_is_copied_back_and_cached_again():
    bm = manager(gpu=8, cpu=4, enable_prefix_caching=True, host_prefix_cache=True)
    first = sequence(9)
    bm.grow(first, 9)
    computed(first, 9)
    bm.register_computed(first)
    bm.drop(first)
    filler = Sequence("f", list(range(200, 232)), SamplingParams(), BS, 1.0)
    bm.grow(filler, 32)  # all eight blocks: both cached blocks are evicted to the host tier
    bm.end_step()
    bm.drop(filler)
    again = sequence(9)
    hits = bm.prefix_hits(again)
    assert [h.on_host for h in hits] == [True, True]
    bm.begin_step()
    assert bm.can_admit(again, hits, 9, use_watermark=False)
    bm.admit(again, hits)
    bm.grow(again, 9)
    moves = bm.end_step()
    assert len(moves.promote) == 2 and again.num_computed_tokens == 8 and len(again.block_table) == 3
    assert bm.cache.num_cached == 2 and bm.prefix_stats.host_hit_tokens == 8
    third = sequence(9)  # now a device hit: the host tier's count keeps what it had
    bm.admit(third, bm.prefix_hits(third))
    assert (bm.prefix_stats.hit_tokens, bm.prefix_stats.host_hit_tokens) == (16, 8)


@pytest.mark.parametrize("count", [None, 2])
def test_host_blocks_needed_matches_what_swap_out_allocates(count):
    bm, seq = manager(), sequence(11)
    bm.grow(seq, 11)
    computed(seq, 11)
    needed = bm.host_blocks_needed([seq], count)
    free = bm.host_pool.num_free
    bm.swap_out(seq, count)
    assert free - bm.host_pool.num_free == needed == (3 if count is None else 2)
