"""The block manager's answers and actions, with no model and no scheduler: exact counts at each edge.

Pins down what counts as free (free blocks plus cached ones nobody uses), when a sequence can
grow or be admitted (exactly at the edge, with prefix hits that revive cached blocks), which
blocks a write must copy, what a partial preemption may take, that prefix names chain across a
sequence's blocks, what each step's moves hold, and that the host pool gets back every block a
move held once the step ends.
"""

import pytest

from kvlib.config import SamplingParams
from kvlib.core.block_allocator import BlockAllocator
from kvlib.core.block_manager import BlockManager
from kvlib.core.prefix_cache import HostPrefixTier, PrefixHit, block_hash
from kvlib.core.sequence import Sequence

BS = 4


def manager(gpu=8, cpu=8, **extra) -> BlockManager:
    return BlockManager(BS, BlockAllocator(gpu), BlockAllocator(cpu), **extra)


def sequence(tokens, request_id="r") -> Sequence:
    tokens = list(range(100, 100 + tokens)) if isinstance(tokens, int) else list(tokens)
    return Sequence(request_id, tokens, SamplingParams(), BS, 0.0)


def running(bm: BlockManager, tokens, request_id="r") -> Sequence:
    """A sequence that holds the blocks for its tokens, all of them computed."""
    seq = sequence(tokens, request_id)
    bm.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.peak_computed_tokens = seq.num_tokens
    return seq


def cached_and_released(bm: BlockManager, tokens, request_id="c") -> Sequence:
    seq = running(bm, tokens, request_id)
    bm.register_computed(seq)
    bm.drop(seq)
    return seq


def test_growing_is_allowed_exactly_up_to_the_free_blocks():
    bm = manager(gpu=4)
    holder = running(bm, 8)  # 2 of 4 blocks
    seq = sequence(9)
    assert bm.blocks_to_grow(seq, 9) == 3 and bm.shortfall(seq, 9) == 1  # what preemption must free
    assert bm.blocks_to_grow(seq, 8) == 2 and bm.shortfall(seq, 8) == 0
    bm.grow(seq, 8)
    assert bm.device_pool.num_free == 0 and len(seq.block_table) == 2
    seq.num_computed_tokens = 7
    assert bm.blocks_to_grow(seq, 8) == 0 and bm.shortfall(seq, 8) == 0  # a write inside its last block
    assert not bm.end_step() and holder.block_table.blocks == [0, 1]


def test_a_write_into_shared_blocks_needs_one_copy_for_each():
    bm = manager()
    parent = running(bm, 6)
    parent.num_computed_tokens = 2  # positions 2..5 are written again: both blocks
    child = sequence(6, "child")
    bm.fork(parent, child)
    assert bm.blocks_to_grow(parent, 6) == 2 and bm.blocks_to_grow(parent, 4) == 1
    assert bm.blocks_to_grow(parent, 7) == 2  # block 1 shared and written, no block missing
    bm.grow(parent, 6)
    moves = bm.end_step()
    assert moves.copies == [(0, 2), (1, 3)] and parent.block_table.blocks == [2, 3]
    assert child.block_table.blocks == [0, 1] and [bm.device_pool.ref_count(b) for b in range(4)] == [1, 1, 1, 1]
    assert moves and moves.to_host == [] and moves.to_device == []


def test_cached_blocks_nobody_uses_count_as_free_and_are_taken_last():
    bm = manager(gpu=4, enable_prefix_caching=True)
    cached_and_released(bm, 9)  # 3 blocks, 2 of them full and cached
    assert bm.device_pool.num_free == 2 and bm.cache.num_evictable == 2 and bm.num_free_blocks == 4
    seq = sequence(range(50, 66))
    assert bm.blocks_to_grow(seq, 16) == 4 and bm.shortfall(seq, 16) == 0
    assert bm.can_admit(seq, [], 16, use_watermark=False)
    assert not bm.can_admit(sequence(range(50, 67)), [], 17, use_watermark=False)
    bm.grow(seq, 16)
    assert sorted(seq.block_table.blocks[:2]) == [2, 3] and bm.cache.num_cached == 0
    assert bm.num_free_blocks == 0 and bm.sharers(seq.block_table.blocks[3]) == 1


def test_a_hit_on_an_unused_cached_block_is_not_counted_as_spare_too():
    bm = manager(gpu=2, enable_prefix_caching=True)
    cached_and_released(bm, 8)  # both blocks cached and evictable, none free
    short, long = sequence(8), sequence(12)
    assert len(bm.prefix_hits(short)) == 1 and len(bm.prefix_hits(long)) == 2
    assert bm.can_admit(short, bm.prefix_hits(short), 8, use_watermark=False)  # the other cached block is spare
    assert not bm.can_admit(long, bm.prefix_hits(long), 12, use_watermark=False)  # both revived: none spare
    hits = bm.prefix_hits(short)
    bm.admit(short, hits)
    assert short.num_computed_tokens == 4 and short.block_table.blocks == [hits[0].block_id]
    assert short.block_hashes == [hits[0].name] and bm.cache.num_evictable == 1
    stats = bm.prefix_stats
    assert (stats.queried_tokens, stats.hit_tokens, stats.host_hit_tokens) == (8, 4, 0)
    assert bm.device_pool.ref_count(hits[0].block_id) == 2 and bm.sharers(hits[0].block_id) == 1


def test_a_prompt_of_whole_blocks_keeps_its_last_token_to_compute():
    bm = manager(enable_prefix_caching=True)
    cached_and_released(bm, 12)
    assert len(bm.prefix_hits(sequence(8))) == 1 and len(bm.prefix_hits(sequence(9))) == 2
    assert len(bm.cached_prefix(list(range(100, 108)))) == 2
    holder = running(bm, 8)
    assert bm.prefix_hits(holder) == []  # it holds blocks already
    assert manager().prefix_hits(sequence(9)) == [] and manager().cached_prefix([1, 2, 3, 4]) == []


def test_names_chain_over_the_blocks_and_are_given_once():
    bm = manager(enable_prefix_caching=True)
    seq = running(bm, 10)
    bm.register_computed(seq)
    first = block_hash(None, (100, 101, 102, 103))
    assert seq.block_hashes == [first, block_hash(first, (104, 105, 106, 107))]
    bm.register_computed(seq)
    assert len(seq.block_hashes) == 2 and bm.cache.num_cached == 2
    assert [bm.device_pool.ref_count(b) for b in seq.block_table.blocks] == [2, 2, 1]
    assert manager().register_computed(seq) is None and seq.block_hashes == [first, seq.block_hashes[1]]


def test_a_partial_preemption_may_take_only_the_unshared_tail():
    bm = manager(enable_prefix_caching=True)
    parent = running(bm, 12)
    bm.register_computed(parent)  # the cache's own reference is not a sharer
    assert bm.unique_tail(parent) == 3 and bm.num_shared(parent) == 0
    child = sequence(12, "child")
    bm.fork(parent, child)
    assert bm.unique_tail(parent) == 0 and bm.num_shared(child) == 3
    bm.grow(child, 13)  # the child's next token opens a block of its own
    assert bm.unique_tail(child) == 1 and bm.num_shared(child) == 3


def test_releasing_the_tail_shrinks_what_is_computed_and_named():
    bm = manager(enable_prefix_caching=True)
    seq = running(bm, 11)
    bm.register_computed(seq)
    assert bm.drop(seq, 2) == 7 and seq.num_computed_tokens == 4 and len(seq.block_hashes) == 1
    assert bm.drop(seq, 0) == 0 and seq.num_computed_tokens == 4
    assert bm.drop(seq) == 4 and bm.device_pool.num_free == 6 and bm.cache.num_evictable == 2


def test_swap_out_and_in_of_one_sequence_moves_each_block_once_each_way():
    bm = manager(gpu=4, cpu=4)
    seq = running(bm, 7)
    bm.begin_step()
    assert bm.host_blocks_needed([seq]) == 2 and bm.host_blocks_needed([seq], 1) == 1
    bm.swap_out(seq)
    assert bm.host_blocks_needed([seq]) == 0  # nothing left on the device
    out = bm.end_step()
    assert out.swap_out == [(0, 0), (1, 1)] and out.to_host == out.swap_out and not out.to_device
    assert seq.host_blocks == [0, 1] and bm.host_pool.num_used == 2 and bm.device_pool.num_free == 4
    assert seq.num_computed_tokens == 7  # its K/V is kept, on the host
    bm.begin_step()
    assert bm.can_swap_in(seq, 8, use_watermark=False)
    bm.swap_in(seq)
    assert bm.host_pool.num_used == 2  # held until the step's copies have run
    back = bm.end_step()
    assert back.swap_in == [(0, 2), (1, 3)] and back.to_device == back.swap_in  # freed blocks are reused last
    assert bm.host_pool.num_used == 0 and seq.host_blocks == [] and seq.block_table.blocks == [2, 3]


def test_swap_in_needs_room_for_the_blocks_and_the_next_position():
    bm = manager(gpu=4, cpu=4, watermark_blocks=1)
    seq = running(bm, 8)
    bm.swap_out(seq)
    bm.end_step()
    filler = running(bm, 4, "filler")  # 3 blocks free
    assert bm.can_swap_in(seq, 8, use_watermark=False) and bm.can_swap_in(seq, 8, use_watermark=True)
    assert bm.can_swap_in(seq, 9, use_watermark=False) and not bm.can_swap_in(seq, 9, use_watermark=True)
    assert filler.block_table.blocks == [2]


def test_a_partly_swapped_sequence_needs_room_only_for_the_blocks_it_gave_up():
    bm = manager(gpu=5, cpu=4)
    seq = running(bm, 12)  # three blocks
    bm.swap_out(seq, 1)  # its tail goes to the host; two stay on the device
    bm.end_step()
    running(bm, 8, "filler")  # two blocks: one left free
    assert len(seq.block_table) == 2 and len(seq.host_blocks) == 1 and bm.device_pool.num_free == 1
    assert bm.can_swap_in(seq, 12, use_watermark=False)  # one block comes back into the one free
    assert not bm.can_swap_in(seq, 13, use_watermark=False)  # the next position needs a fourth


def test_swapping_out_two_samples_that_share_moves_the_shared_block_once():
    bm = manager()
    parent = running(bm, 8)
    child = sequence(8, "child")
    bm.fork(parent, child)
    bm.begin_step()
    assert bm.host_blocks_needed([parent, child]) == 2
    bm.swap_out(parent)
    bm.swap_out(child)
    moves = bm.end_step()
    assert len(moves.swap_out) == 2 and child.host_blocks == parent.host_blocks
    assert [bm.host_pool.ref_count(b) for b in parent.host_blocks] == [2, 2] and bm.device_pool.num_free == 8


def test_host_room_comes_from_the_host_tier_before_a_swap():
    bm = manager(gpu=2, cpu=1, enable_prefix_caching=True, host_prefix_cache=True)
    cached_and_released(bm, 5)  # block 0 cached, block 1 free
    filler = sequence(range(40, 48), "filler")
    bm.begin_step()
    bm.grow(filler, 8)  # takes the cached block: demoted to the host tier
    moves = bm.end_step()
    assert moves.demote == [(0, 0)] and moves.to_host == [(0, 0)] and bm.host_tier.num_cached == 1
    assert bm.host_pool.num_free == 0 and bm.make_host_room(0)
    assert bm.make_host_room(1) and bm.host_pool.num_free == 1 and bm.host_tier.num_cached == 0
    assert not bm.make_host_room(2) and not manager(cpu=0).make_host_room(1)


def test_an_evicted_block_is_demoted_once_and_only_while_the_host_has_room():
    bm = manager(gpu=1, cpu=1, enable_prefix_caching=True, host_prefix_cache=True)
    cached_and_released(bm, 4, "first")
    assert bm.cache.num_evictable == 1 and bm.device_pool.num_free == 0
    bm.begin_step()
    second = running(bm, range(20, 24), "second")  # evicts first's block to the host
    bm.register_computed(second)
    assert bm.end_step().demote == [(0, 0)]
    bm.drop(second)
    bm.begin_step()
    running(bm, range(60, 64), "third")  # evicts second's block; the host tier makes room
    moves = bm.end_step()
    assert moves.demote == [(0, 0)] and [e.tokens for e in bm.host_tier] == [(20, 21, 22, 23)]
    assert manager(gpu=1, enable_prefix_caching=True).take() == 0



def test_a_block_filled_to_its_last_slot_is_swapped_out_once_for_every_sample():
    bm = manager()
    parent = running(bm, 8)  # two blocks, both exactly full
    child = sequence(8, "child")
    bm.fork(parent, child)
    bm.begin_step()
    bm.swap_out(parent)
    bm.end_step()
    bm.begin_step()  # a later step: both full blocks have host twins
    assert bm.host_blocks_needed([child]) == 0
    bm.swap_out(child)
    assert not bm.end_step().swap_out and child.host_blocks == parent.host_blocks


def test_the_cached_prefix_reaches_into_the_host_tier():
    bm = manager(gpu=1, cpu=2, enable_prefix_caching=True, host_prefix_cache=True)
    cached_and_released(bm, 4)
    running(bm, range(20, 24), "other")  # evicts the cached block to the host tier
    bm.end_step()
    assert [h.on_host for h in bm.cached_prefix(list(range(100, 104)))] == [True]


def test_the_plainest_manager_keeps_no_watermark_no_cache_and_no_host_tier():
    bm = BlockManager(BS, BlockAllocator(2), BlockAllocator(2))
    assert bm.watermark_blocks == 0 and bm.cache is None and bm.host_tier is None
    seq = sequence(8)
    assert bm.can_admit(seq, [], 8, use_watermark=True)  # both blocks: nothing is kept back
    bm.admit(seq, [])
    assert bm.prefix_stats.queried_tokens == 0  # no cache: nothing was looked up


def test_an_admission_with_prefix_hits_keeps_the_watermark_free_too():
    bm = manager(gpu=4, enable_prefix_caching=True, watermark_blocks=1)
    holder = running(bm, 8, "holder")  # two full blocks, cached and in use: a hit shares them
    bm.register_computed(holder)
    seq = sequence(12)
    hits = bm.prefix_hits(seq)
    assert len(hits) == 2  # one new block needed, two free: the watermark's one must stay free
    assert bm.can_admit(seq, hits, 12, use_watermark=True)
    assert not bm.can_admit(seq, hits, 13, use_watermark=True)  # two new blocks would eat the watermark
    assert bm.can_admit(seq, hits, 13, use_watermark=False)


def test_a_readmitted_sequence_is_not_counted_as_a_new_prefix_query():
    bm = manager(gpu=8, enable_prefix_caching=True)
    seq = running(bm, 6)
    queried = bm.prefix_stats.queried_tokens
    bm.admit(seq, [])  # it already holds blocks (a partial preemption left its head on the device)
    assert bm.prefix_stats.queried_tokens == queried


def test_a_block_copied_back_from_the_host_tier_is_a_device_hit_for_the_next_request():
    bm = manager(gpu=2, cpu=4, enable_prefix_caching=True, host_prefix_cache=True)
    cached_and_released(bm, 4)
    bm.drop(running(bm, range(20, 28), "filler"))  # both blocks taken: the cached one moves to the host tier
    bm.end_step()
    first = sequence(5)
    hits = bm.prefix_hits(first)
    assert [h.on_host for h in hits] == [True]
    bm.begin_step()
    bm.admit(first, hits)
    bm.end_step()
    later = sequence(5, "later")
    assert bm.prefix_hits(later) == [PrefixHit(block_hash(None, (100, 101, 102, 103)), first.block_table.blocks[0])]


def test_the_prefix_counters_add_up_over_every_query():
    bm = manager(gpu=8, enable_prefix_caching=True)
    cached_and_released(bm, 8)  # two named blocks of tokens 100..107
    expected = [0, 0]
    for request_id, tokens in (("a", 9), ("b", 6), ("c", range(50, 53))):
        seq = sequence(tokens, request_id)
        hits = bm.prefix_hits(seq)
        bm.admit(seq, hits)
        expected = [expected[0] + seq.num_tokens, expected[1] + len(hits) * BS]
    assert expected == [9 + 6 + 3, 8 + 4 + 0]
    stats = bm.prefix_stats
    assert [stats.queried_tokens, stats.hit_tokens, stats.host_hit_tokens] == [18, 12, 0]


def test_a_host_tier_hit_costs_one_new_device_block_exactly():
    bm = manager(gpu=3, cpu=4, enable_prefix_caching=True, host_prefix_cache=True)
    cached_and_released(bm, 4)  # tokens 100..103 named in block 0
    bm.drop(running(bm, range(20, 32), "filler"))  # all three blocks: the cached one moves to the host tier
    bm.end_step()
    seq = sequence(9)  # its first block is on the host tier, the second and the third are new
    hits = bm.prefix_hits(seq)
    assert [h.on_host for h in hits] == [True] and bm.num_free_blocks == 3
    assert bm.can_admit(seq, hits, 9, use_watermark=False)  # 1 copied back + 2 new = 3: the whole pool
    held = sequence(1, "held")
    bm.grow(held, 1)
    assert not bm.can_admit(seq, hits, 9, use_watermark=False)
    assert bm.can_admit(seq, hits, 8, use_watermark=False)  # 1 copied back + 1 new
    bm.drop(held)
    bm.begin_step()
    bm.admit(seq, hits)
    bm.grow(seq, 9)
    assert len(bm.end_step().promote) == 1 and len(seq.block_table) == 3 and bm.num_free_blocks == 0


def test_a_partly_preempted_sequence_takes_its_tail_back_from_the_prefix_cache():
    bm = manager(gpu=8, enable_prefix_caching=True)
    seq = running(bm, 14)  # blocks 0-2 full and named, block 3 holds 2 tokens
    bm.register_computed(seq)
    tail = seq.block_table.blocks[1:3]
    assert bm.drop(seq, 3) == 10 and seq.num_computed_tokens == 4  # its head block stays on the device
    hits = bm.prefix_hits(seq)
    assert [h.block_id for h in hits] == tail and not any(h.on_host for h in hits)
    assert [h.name for h in hits] == [block_hash(seq.block_hashes[0], (104, 105, 106, 107)), hits[1].name]
    queried = bm.prefix_stats.queried_tokens
    bm.admit(seq, hits)
    assert seq.num_computed_tokens == 12 and seq.block_table.blocks[1:] == tail and len(seq.block_hashes) == 3
    assert bm.prefix_stats.queried_tokens == queried  # a resumption is not a new prompt's lookup
    assert bm.blocks_to_grow(seq, 14) == 1 and bm.cache.num_evictable == 0


def test_a_resumed_sequence_counts_the_blocks_it_holds_when_asking_for_room():
    bm = manager(gpu=4, enable_prefix_caching=True)
    seq = running(bm, 13)  # all four blocks, three of them named
    bm.register_computed(seq)
    bm.drop(seq, 3)  # keeps block 0; blocks 1-2 stay cached and evictable, block 3 is free
    hits = bm.prefix_hits(seq)
    assert len(hits) == 2 and bm.num_free_blocks == 3
    assert bm.can_admit(seq, hits, 13, use_watermark=False)  # 1 held + 2 hits + 1 new = the whole pool
    other = running(bm, range(50, 51), "other")  # takes the free block
    assert not bm.can_admit(seq, hits, 13, use_watermark=False)
    assert bm.can_admit(seq, hits, 12, use_watermark=False)
    bm.drop(other)


def test_a_sequence_whose_kept_blocks_are_not_all_named_looks_nothing_up():
    bm = manager(gpu=8, enable_prefix_caching=True)
    seq = running(bm, 9)
    bm.register_computed(seq)
    bm.drop(seq, 1)
    seq.num_computed_tokens = 6  # a head not fully computed: the names no longer say what it holds
    assert bm.prefix_hits(seq) == []
    assert manager(enable_prefix_caching=True).prefix_hits(running(manager(), 8)) == []  # holds unnamed blocks


def test_a_tier_that_raises_while_a_resumed_sequence_is_admitted_leaves_it_its_head():
    class Broken(HostPrefixTier):
        def touch(self, name):
            raise RuntimeError("tier broke")

    bm = manager(gpu=3, cpu=4, enable_prefix_caching=True, host_prefix_cache=True, host_tier_factory=Broken)
    seq = running(bm, 9)
    bm.register_computed(seq)
    bm.drop(seq, 2)  # keeps block 0; block 1 is cached and evictable
    bm.drop(running(bm, range(20, 28), "filler"))  # takes the free block and evicts block 1 to the host tier
    bm.end_step()
    head = list(seq.block_table.blocks)
    hits = bm.prefix_hits(seq)
    assert [h.on_host for h in hits] == [True]
    bm.begin_step()
    with pytest.raises(RuntimeError, match="tier broke"):
        bm.admit(seq, hits)
    bm.end_step()
    assert seq.block_table.blocks == head and seq.num_computed_tokens == 4 and len(seq.block_hashes) == 1
    assert bm.device_pool.ref_count(head[0]) == 2  # its own reference and the cache's
