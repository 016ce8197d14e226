"""The persistent input buffers: what one packed step holds, and that its shapes never change with the step."""
import pytest
import torch

from kvlib.runner.step_inputs import PADDING, Chunk, InputBuffers, table_width

BLOCK_SIZE = 4


def buffers(max_tokens=64, max_seqs=8, width=16):
    return InputBuffers(max_tokens, max_seqs, width, torch.device("cpu"), block_size=BLOCK_SIZE)


def test_decodes_are_packed_first_and_logits_rows_keep_chunk_order():
    prompt = Chunk([11, 12, 13], 0, [5], sampled=True)  # positions 0-2 in block 5
    decode = Chunk([21], 6, [2, 7], sampled=True)  # position 6: block 7, offset 2
    middle = Chunk([31, 32], 4, [1, 3, 4], sampled=False)  # a prompt chunk that produces no token
    inputs = buffers().pack([prompt, decode, middle])
    assert inputs.token_ids.tolist() == [21, 11, 12, 13, 31, 32]
    assert inputs.positions.tolist() == [6, 0, 1, 2, 4, 5]
    assert inputs.meta.slot_mapping.tolist() == [7 * 4 + 2, 5 * 4, 5 * 4 + 1, 5 * 4 + 2, 3 * 4, 3 * 4 + 1]
    assert inputs.meta.num_decodes == 1
    assert inputs.meta.context_lens.tolist() == [7, 3, 6]
    assert inputs.meta.query_start.tolist() == [0, 1, 4, 6]
    assert inputs.logits_rows.tolist() == [3, 0]  # the prompt's last row, then the decode's: the chunks' order
    assert (inputs.meta.max_query_len, inputs.meta.max_context_len) == (3, 7)


def test_block_tables_have_a_fixed_width_padded_with_zeros():
    b = buffers(width=16)
    first = b.pack([Chunk([1], 0, [9], sampled=True)])
    assert first.meta.block_tables.shape == (1, 16)
    b.pack([Chunk([1, 2], 0, list(range(1, 13)), sampled=True), Chunk([3], 0, [4], sampled=True)])
    again = b.pack([Chunk([1], 0, [9], sampled=True)])
    assert again.meta.block_tables.tolist() == [[9] + [0] * 15]  # nothing left over from the longer step


def test_table_width_is_a_multiple_of_16_and_holds_the_longest_sequence():
    assert table_width(2048, 16) == 128
    assert table_width(1000, 16) == 64  # 63 blocks, rounded up
    assert table_width(5, 16) == 16


def test_padding_stores_nothing_and_pads_to_the_bucket():
    inputs = buffers().pack([Chunk([5], 3, [2], sampled=True)], max_context_len=40, pad_to=4)
    assert inputs.token_ids.shape == (4,) and inputs.meta.num_decodes == 4
    assert inputs.meta.slot_mapping.tolist() == [2 * 4 + 3, -1, -1, -1]
    assert inputs.meta.context_lens.tolist() == [4, 1, 1, 1]
    assert inputs.meta.max_context_len == 40
    assert inputs.logits_rows.tolist() == [0]
    assert PADDING.block_table == [] and not PADDING.sampled


def test_the_same_sizes_land_at_the_same_addresses():
    """What a CUDA graph relies on: a step of the same sizes reads the same memory, whatever its contents."""
    b = buffers()
    views = [b.pack([Chunk([t], t, [t], sampled=True), Chunk([t + 1], 1, [0], sampled=True)])
             for t in (1, 2)]
    for name in ("token_ids", "positions", "logits_rows"):
        assert getattr(views[0], name).data_ptr() == getattr(views[1], name).data_ptr()
    for name in ("slot_mapping", "block_tables", "context_lens", "query_start"):
        assert getattr(views[0].meta, name).data_ptr() == getattr(views[1].meta, name).data_ptr()


def test_a_step_larger_than_the_buffers_is_refused():
    with pytest.raises(ValueError, match="larger than the input buffers"):
        buffers(max_tokens=4).pack([Chunk([1] * 5, 0, [0, 1], sampled=True)])
    with pytest.raises(ValueError, match="raise max_model_len"):
        buffers(width=16).pack([Chunk([1], 0, list(range(17)), sampled=True)])


def with_device_copies(b: InputBuffers) -> InputBuffers:
    """The buffers with device twins apart from the host buffers, as on a GPU (here CPU tensors), so a pack's copies
    to the device are what the tables the kernels read hold."""
    b.device64, b.device32 = torch.zeros_like(b.host64), torch.zeros_like(b.host32)
    b.device_tables = torch.zeros_like(b.host_tables)
    return b


def random_tables(rng, count: int, width: int, previous: list[list[int]]) -> list[list[int]]:
    """Tables as serving changes them: kept, grown by a block, copied on write, shortened, moved, replaced."""
    tables = []
    for i in range(count):
        table = list(previous[i]) if i < len(previous) else []
        move = rng.random()
        if move < 0.3 and len(table) < width:
            table.append(rng.randrange(1, 500))
        elif move < 0.4 and table:
            table[rng.randrange(len(table))] = rng.randrange(1, 500)
        elif move < 0.5 and table:
            del table[rng.randrange(len(table)):]
        elif move < 0.6:
            table = [rng.randrange(1, 500) for _ in range(rng.randrange(width + 1))]
        tables.append(table)
    if rng.random() < 0.2 and tables:
        tables.insert(0, tables.pop())  # a sequence finished or joined: the rows after it shift
    return tables


@pytest.mark.parametrize("seed", range(6))
def test_tables_written_in_place_are_exactly_a_rebuild(seed):
    import random
    rng = random.Random(seed)
    width, kept, tables = 48, with_device_copies(buffers(max_seqs=8, width=48)), []
    for _ in range(60):
        tables = random_tables(rng, rng.randrange(1, 9), width, tables)
        chunks = [Chunk([1], max(0, 4 * len(t) - 1), t, sampled=True) if t else PADDING for t in tables]
        packed = kept.pack(chunks).meta.block_tables
        fresh = buffers(max_seqs=8, width=48).pack(chunks).meta.block_tables
        assert torch.equal(packed, fresh)


class CopiedEntries(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.int32 = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and args[1].dtype == torch.int32:
            self.int32 += args[1].numel()
        if func is torch._foreach_copy_:
            self.int32 += sum(t.numel() for t in args[1] if t.dtype == torch.int32)
        return func(*args, **(kwargs or {}))


def test_a_decode_step_copies_only_the_table_entries_that_changed():
    """At 128k tokens a row is 8,192 columns: every step cleared and copied each full row."""
    b = with_device_copies(buffers(max_seqs=4, width=8192))
    tables = [list(range(1, 600)), list(range(700, 1000))]
    b.pack([Chunk([1], 4 * len(t) - 1, t, sampled=True) for t in tables])
    counted = CopiedEntries()
    with counted:
        b.pack([Chunk([1], 4 * len(t) - 2, t, sampled=True) for t in tables])  # the same blocks
    assert counted.int32 == 2 * 2 + 1  # context lengths and query starts; no table entry
    tables[1].append(5)
    with counted:
        b.pack([Chunk([1], 4 * len(t) - 4, t, sampled=True) for t in tables])
    assert counted.int32 == 5 + 5 + 1  # and the one block appended
