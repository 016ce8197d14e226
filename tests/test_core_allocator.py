"""The allocator, the block table and block sharing, each on its own: exact ids, counts and errors.

Pins down the free list's order (a freed block is handed out after every block that was free
before it), the admission answer at each edge of the watermark, the message of every bookkeeping
error, a table's slots and tail, and that copy-on-write touches only the writer's entry.
"""
import pytest

from kvlib.core.block_allocator import AllocStatus, BlockAllocator, BlockAllocatorError
from kvlib.core.block_table import BlockTable, blocks_for
from kvlib.core.sharing import BlockSharing


def test_an_empty_pool_is_allowed_and_a_negative_one_refused():
    empty = BlockAllocator(0)
    assert (empty.num_blocks, empty.num_free, empty.num_used) == (0, 0, 0)
    assert empty.can_allocate(0) is AllocStatus.OK and empty.can_allocate(1) is AllocStatus.NEVER
    with pytest.raises(ValueError, match=r"^num_blocks must be >= 0, got -1$"):
        BlockAllocator(-1)


def test_the_free_list_hands_out_blocks_in_order_and_reuses_freed_ones_last():
    allocator = BlockAllocator(3)
    assert [allocator.allocate(), allocator.allocate()] == [0, 1]
    allocator.free(0)
    assert [allocator.allocate(), allocator.allocate()] == [2, 0]
    assert [allocator.ref_count(b) for b in range(3)] == [1, 1, 1]
    with pytest.raises(BlockAllocatorError, match=r"^no free block left in a pool of 3$"):
        allocator.allocate()


def test_reference_counts_follow_every_fork_and_free():
    allocator = BlockAllocator(4)
    block = allocator.allocate()
    assert allocator.fork(block) == block and allocator.fork(block) == block
    assert allocator.ref_count(block) == 3 and (allocator.num_free, allocator.num_used) == (3, 1)
    allocator.free(block)
    assert allocator.ref_count(block) == 2 and allocator.num_free == 3
    allocator.free(block)
    allocator.free(block)
    assert allocator.ref_count(block) == 0 and (allocator.num_free, allocator.num_used) == (4, 0)


@pytest.mark.parametrize("action", ["fork", "free"])
def test_every_bookkeeping_mistake_names_the_action_and_the_block(action):
    allocator = BlockAllocator(4)
    allocator.allocate()
    with pytest.raises(BlockAllocatorError, match=rf"^cannot {action} block 4: ids run from 0 to 3$"):
        getattr(allocator, action)(4)
    with pytest.raises(BlockAllocatorError, match=rf"^cannot {action} block -1: ids run from 0 to 3$"):
        getattr(allocator, action)(-1)
    with pytest.raises(BlockAllocatorError,
                       match=rf"^cannot {action} block 2: it is free \(double free or never allocated\)$"):
        getattr(allocator, action)(2)
    assert allocator.ref_count(0) == 1 and allocator.num_free == 3  # a refused call changes nothing


@pytest.mark.parametrize("used, needed, watermark, answer", [
    (0, 8, 2, AllocStatus.OK),        # the largest request the watermark admits: 10 - 8 = 2 left
    (0, 9, 2, AllocStatus.NEVER),     # more than the pool can ever give above the watermark
    (2, 6, 2, AllocStatus.OK),        # 8 free - 6 = 2: exactly the watermark
    (3, 6, 2, AllocStatus.LATER),     # 7 free - 6 = 1 < 2
    (3, 7, 0, AllocStatus.OK),        # no watermark: every free block may go
    (3, 8, 0, AllocStatus.LATER),
    (0, 10, 0, AllocStatus.OK),
    (0, 11, 0, AllocStatus.NEVER),
    (10, 0, 0, AllocStatus.OK),       # nothing needed, nothing free
])
def test_admission_at_each_edge(used, needed, watermark, answer):
    allocator = BlockAllocator(10)
    for _ in range(used):
        allocator.allocate()
    assert allocator.can_allocate(needed, watermark_blocks=watermark) is answer


@pytest.mark.parametrize("tokens, block_size, blocks", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (16, 16, 1)])
def test_blocks_for_rounds_up(tokens, block_size, blocks):
    assert blocks_for(tokens, block_size) == blocks


def test_a_block_table_maps_positions_to_slots_and_gives_up_its_tail():
    table = BlockTable(4, [7, 2, 9])
    assert len(table) == 3 and table.capacity == 12
    assert table.slots(2, 6) == [30, 31, 8, 9] and table.slot(11) == 39
    assert [table.num_missing_blocks(n) for n in (0, 12, 13, 21)] == [0, 0, 1, 3]
    table.append(5)
    assert table.pop_tail(2) == [9, 5] and table.blocks == [7, 2]
    assert table.pop_tail(0) == [] and table.blocks == [7, 2]


def test_a_fork_shares_every_block_by_reference():
    allocator = BlockAllocator(4)
    blocks = [allocator.allocate() for _ in range(3)]
    child = BlockSharing().fork(allocator, blocks)
    assert child == blocks and child is not blocks
    assert [allocator.ref_count(b) for b in range(4)] == [2, 2, 2, 0]


def test_a_private_block_is_written_in_place():
    allocator = BlockAllocator(4)
    blocks = [allocator.allocate(), allocator.allocate()]
    taken = []
    assert BlockSharing().make_writable(allocator, blocks, 1, lambda: taken.append(1) or 3) is None
    assert blocks == [0, 1] and not taken and allocator.ref_count(1) == 1


def test_only_the_writer_gets_a_copy_of_a_shared_block():
    allocator = BlockAllocator(4)
    writer = [allocator.allocate(), allocator.allocate()]
    reader = BlockSharing().fork(allocator, writer)
    copy = BlockSharing().make_writable(allocator, writer, 1, allocator.allocate)
    assert copy == (1, 2) and writer == [0, 2] and reader == [0, 1]
    assert [allocator.ref_count(b) for b in range(4)] == [2, 1, 1, 0]
