"""The persistent input buffers: what one packed step holds, and that its shapes never change with the step."""
import pytest
import torch

from kvlib.runner.step_inputs import PADDING, Chunk, InputBuffers, table_width

BLOCK_SIZE = 4


def buffers(max_tokens=64, max_seqs=8, width=16):
    return InputBuffers(max_tokens, max_seqs, width, torch.device("cpu"))


def test_decodes_are_packed_first_and_logits_rows_keep_chunk_order():
    prompt = Chunk([11, 12, 13], 0, [5], sampled=True)  # positions 0-2 in block 5
    decode = Chunk([21], 6, [2, 7], sampled=True)  # position 6: block 7, offset 2
    middle = Chunk([31, 32], 4, [1, 3, 4], sampled=False)  # a prompt chunk that produces no token
    inputs = buffers().pack([prompt, decode, middle], BLOCK_SIZE)
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
    first = b.pack([Chunk([1], 0, [9], sampled=True)], BLOCK_SIZE)
    assert first.meta.block_tables.shape == (1, 16)
    b.pack([Chunk([1, 2], 0, list(range(1, 13)), sampled=True), Chunk([3], 0, [4], sampled=True)], BLOCK_SIZE)
    again = b.pack([Chunk([1], 0, [9], sampled=True)], BLOCK_SIZE)
    assert again.meta.block_tables.tolist() == [[9] + [0] * 15]  # nothing left over from the longer step


def test_table_width_is_a_multiple_of_16_and_holds_the_longest_sequence():
    assert table_width(2048, 16) == 128
    assert table_width(1000, 16) == 64  # 63 blocks, rounded up
    assert table_width(5, 16) == 16


def test_padding_stores_nothing_and_pads_to_the_bucket():
    inputs = buffers().pack([Chunk([5], 3, [2], sampled=True)], BLOCK_SIZE, max_context_len=40, pad_to=4)
    assert inputs.token_ids.shape == (4,) and inputs.meta.num_decodes == 4
    assert inputs.meta.slot_mapping.tolist() == [2 * 4 + 3, -1, -1, -1]
    assert inputs.meta.context_lens.tolist() == [4, 1, 1, 1]
    assert inputs.meta.max_context_len == 40
    assert inputs.logits_rows.tolist() == [0]
    assert PADDING.block_table == [] and not PADDING.sampled


def test_the_same_sizes_land_at_the_same_addresses():
    """What a CUDA graph relies on: a step of the same sizes reads the same memory, whatever its contents."""
    b = buffers()
    views = [b.pack([Chunk([t], t, [t], sampled=True), Chunk([t + 1], 1, [0], sampled=True)], BLOCK_SIZE)
             for t in (1, 2)]
    for name in ("token_ids", "positions", "logits_rows"):
        assert getattr(views[0], name).data_ptr() == getattr(views[1], name).data_ptr()
    for name in ("slot_mapping", "block_tables", "context_lens", "query_start"):
        assert getattr(views[0].meta, name).data_ptr() == getattr(views[1].meta, name).data_ptr()


def test_a_step_larger_than_the_buffers_is_refused():
    with pytest.raises(ValueError, match="larger than the input buffers"):
        buffers(max_tokens=4).pack([Chunk([1] * 5, 0, [0, 1], sampled=True)], BLOCK_SIZE)
    with pytest.raises(ValueError, match="raise max_model_len"):
        buffers(width=16).pack([Chunk([1], 0, list(range(17)), sampled=True)], BLOCK_SIZE)
