"""The allocator and block table, alone: bookkeeping under random workloads."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.core.block_allocator import AllocStatus, BlockAllocator, BlockAllocatorError
from kvlib.core.block_table import BlockTable, blocks_for

operations = st.lists(st.tuples(st.sampled_from(["allocate", "fork", "free"]), st.integers(0, 10_000)), max_size=200)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 24), ops=operations)
def test_random_workload_keeps_invariants(num_blocks, ops):
    allocator = BlockAllocator(num_blocks)
    owners: list[int] = []  # one entry per ownership, like the sequences' block tables
    for op, pick in ops:
        if op == "allocate":
            if allocator.num_free == 0:
                with pytest.raises(BlockAllocatorError):
                    allocator.allocate()
                continue
            block = allocator.allocate()
            assert block not in owners, "handed out a block that is still owned"
            owners.append(block)
        elif op == "fork" and owners:
            owners.append(allocator.fork(owners[pick % len(owners)]))
        elif op == "free" and owners:
            allocator.free(owners.pop(pick % len(owners)))
        for block in range(num_blocks):
            assert allocator.ref_count(block) == owners.count(block)
        assert allocator.num_free == sum(1 for b in range(num_blocks) if b not in owners)
        assert allocator.num_free + allocator.num_used == num_blocks


def test_double_free_and_unowned_free_raise():
    allocator = BlockAllocator(4)
    block = allocator.allocate()
    allocator.free(block)
    with pytest.raises(BlockAllocatorError, match="double free"):
        allocator.free(block)
    with pytest.raises(BlockAllocatorError, match="ids run from 0 to 3"):
        allocator.free(7)
    with pytest.raises(BlockAllocatorError):
        allocator.fork(2)


def test_shared_block_returns_only_when_last_owner_frees():
    allocator = BlockAllocator(2)
    block = allocator.allocate()
    allocator.fork(block)
    allocator.free(block)
    assert allocator.num_free == 1 and allocator.ref_count(block) == 1
    allocator.free(block)
    assert allocator.num_free == 2


def test_admission_answers_with_watermark():
    allocator = BlockAllocator(10)
    for _ in range(6):
        allocator.allocate()
    assert allocator.can_allocate(3, watermark_blocks=1) is AllocStatus.OK  # 4 free - 3 = 1 left
    assert allocator.can_allocate(4, watermark_blocks=1) is AllocStatus.LATER
    assert allocator.can_allocate(9, watermark_blocks=1) is AllocStatus.LATER
    assert allocator.can_allocate(10, watermark_blocks=1) is AllocStatus.NEVER


@given(block_size=st.integers(1, 32), length=st.integers(0, 300))
def test_block_table_slots(block_size, length):
    table = BlockTable(block_size)
    for i in range(table.num_missing_blocks(length)):
        table.append(100 + 3 * i)  # scattered, non-contiguous physical blocks
    assert len(table) == blocks_for(length, block_size) and table.capacity >= length
    for position in range(length):
        block, offset = divmod(table.slot(position), block_size)
        assert block == table.blocks[position // block_size] and offset == position % block_size
    assert table.num_missing_blocks(length) == 0
    tail = table.pop_tail(min(2, len(table)))
    assert len(table) == max(0, blocks_for(length, block_size) - 2) and len(tail) == min(2, blocks_for(length, block_size))
