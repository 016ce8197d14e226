"""The prefix cache and its host tier on their own: names, hits, reference counts and eviction order.

Pins down that a name is chained over every block before it and a hit also compares the tokens,
that matching stops at the first miss and never counts a partly filled block, that the cache
holds exactly one reference per named block, that eviction takes the least recently released
block (a sequence's tail before its head) and that the host tier evicts its least recently used
block that no move holds.
"""
from kvlib.core.block_allocator import BlockAllocator
from kvlib.core.prefix_cache import HostPrefixTier, PrefixCache, PrefixHit, block_hash, match_prefix

BS = 2


def named(cache: PrefixCache, token_ids: list[int]) -> list[int]:
    """Fill and name one block per ``BS`` tokens, as a sequence would; returns the block ids."""
    blocks, name = [], None
    for start in range(0, len(token_ids) - BS + 1, BS):
        tokens = tuple(token_ids[start:start + BS])
        name = block_hash(name, tokens)
        block = cache.allocator.allocate()
        cache.insert(name, tokens, block)
        blocks.append(block)
    return blocks


def test_a_name_depends_on_every_block_before_it():
    first = block_hash(None, (1, 2))
    assert block_hash(first, (3, 4)) == block_hash(block_hash(None, (1, 2)), (3, 4))
    assert block_hash(first, (3, 4)) != block_hash(block_hash(None, (9, 2)), (3, 4))
    assert block_hash(None, (3, 4)) != block_hash(first, (3, 4))


def test_the_cache_takes_one_reference_per_named_block_and_ignores_a_second_name():
    cache = PrefixCache(BlockAllocator(4))
    blocks = named(cache, [1, 2, 3, 4])
    assert [cache.allocator.ref_count(b) for b in blocks] == [2, 2]
    assert cache.num_cached == 2 and blocks[0] in cache and 3 not in cache
    cache.insert(block_hash(None, (1, 2)), (1, 2), 3)   # the name is taken
    cache.insert(12345, (7, 7), blocks[1])               # the block is named already
    assert cache.num_cached == 2 and [cache.allocator.ref_count(b) for b in blocks] == [2, 2]
    assert sorted(e.block_id for e in cache) == blocks


def test_a_hit_needs_the_same_tokens_under_the_same_name():
    cache = PrefixCache(BlockAllocator(4))
    named(cache, [1, 2])
    name = block_hash(None, (1, 2))
    assert cache.lookup(name, (1, 2)).block_id == 0
    assert cache.lookup(name, (1, 3)) is None and cache.lookup(name + 1, (1, 2)) is None


def test_matching_stops_at_the_first_miss_and_skips_the_partial_block():
    cache = PrefixCache(BlockAllocator(8))
    blocks = named(cache, [1, 2, 3, 4, 5, 6])
    assert [h.block_id for h in match_prefix([1, 2, 3, 4, 5, 6, 7], BS, cache)] == blocks
    assert [h.block_id for h in match_prefix([1, 2, 3, 4, 5], BS, cache)] == blocks[:2]
    assert [h.block_id for h in match_prefix([1, 2, 9, 4, 5, 6], BS, cache)] == blocks[:1]
    assert match_prefix([9, 2, 3, 4], BS, cache) == [] and match_prefix([1], BS, cache) == []
    assert all(not h.on_host for h in match_prefix([1, 2, 3, 4], BS, cache))


def test_released_blocks_are_evicted_tail_first_then_in_release_order():
    allocator = BlockAllocator(8)
    cache = PrefixCache(allocator)
    first, second = named(cache, [1, 2, 3, 4]), named(cache, [5, 6, 7, 8])
    assert cache.evict_one() is None  # every block is still in use
    for block in first + second:
        allocator.free(block)  # the sequences let go; only the cache holds them now
    cache.released(first)
    cache.released(second)
    assert cache.num_evictable == 4 and allocator.num_free == 4
    evicted = [cache.evict_one() for _ in range(4)]
    assert [e.block_id for e in evicted] == [first[1], first[0], second[1], second[0]]
    assert evicted[1].tokens == (1, 2) and evicted[1].name == block_hash(None, (1, 2))
    assert cache.num_cached == 0 and cache.num_evictable == 0 and allocator.num_free == 8
    assert cache.evict_one() is None and match_prefix([1, 2, 3], BS, cache) == []


def test_a_block_someone_still_holds_is_not_evictable():
    allocator = BlockAllocator(4)
    cache = PrefixCache(allocator)
    blocks = named(cache, [1, 2, 3, 4])
    allocator.free(blocks[1])  # one sequence lets go of its tail, another still holds block 0
    cache.released(blocks)
    assert cache.num_evictable == 1
    allocator.fork(blocks[1])  # a later request takes the cached tail
    cache.acquired(blocks[1])
    cache.acquired(blocks[1])  # acquiring a block that is not evictable is harmless
    assert cache.num_evictable == 0 and cache.evict_one() is None
    assert [allocator.ref_count(b) for b in blocks] == [2, 2]


def test_the_host_tier_serves_what_the_device_tier_lost():
    device, host = PrefixCache(BlockAllocator(4)), HostPrefixTier(BlockAllocator(4))
    blocks = named(device, [1, 2])
    second = block_hash(block_hash(None, (1, 2)), (3, 4))
    host.put(second, (3, 4), host.allocator.allocate())
    hits = match_prefix([1, 2, 3, 4, 5, 6], BS, device, host.lookup)
    assert hits == [PrefixHit(block_hash(None, (1, 2)), blocks[0]), PrefixHit(second, 0, on_host=True)]
    assert second in host and host.num_cached == 1 and host.lookup(second, (3, 5)) is None
    assert match_prefix([1, 2, 3, 4], BS, device) == hits[:1]  # without the tier: the device hit only


def test_the_host_tier_evicts_its_least_recently_used_block_that_no_move_holds():
    allocator = BlockAllocator(3)
    tier = HostPrefixTier(allocator)
    for name in (10, 11, 12):
        tier.put(name, (name,), allocator.allocate())
    tier.touch(10)  # used again: now the newest
    allocator.fork(1)  # a move of this step reads block 1 (name 11)
    assert tier.evict_one() is True
    assert [e.name for e in tier] == [11, 10] and allocator.ref_count(2) == 0
    assert tier.evict_one() is True and [e.name for e in tier] == [11]
    assert tier.evict_one() is False and tier.num_cached == 1 and allocator.num_free == 2
