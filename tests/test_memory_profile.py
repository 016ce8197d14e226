"""Sizing the device pool: the dummy largest step and the budget arithmetic (the measurement needs a GPU)."""
from kvlib.runner.memory_profile import blocks_needed, dummy_chunks, kv_budget_bytes


def test_dummy_step_has_every_token_and_every_sequence_sampled():
    chunks = dummy_chunks(num_tokens=10, num_seqs=4, block_size=2, max_len=100)
    assert [len(c.token_ids) for c in chunks] == [3, 3, 2, 2]
    assert all(c.sampled and c.start == 0 for c in chunks)
    assert [c.block_table for c in chunks] == [[0, 1], [2, 3], [4], [5]]
    assert blocks_needed(chunks) == 6


def test_more_sequences_than_tokens_means_one_token_each():
    assert [len(c.token_ids) for c in dummy_chunks(3, 8, 16, max_len=100)] == [1, 1, 1]


def test_no_dummy_sequence_is_longer_than_the_model_serves():
    """Two sequences of at most 1,000 tokens: the scheduler can make no step of 4,096 tokens of them."""
    assert [len(c.token_ids) for c in dummy_chunks(4096, 2, 16, max_len=1000)] == [1000, 1000]


def test_budget_is_the_free_share_less_what_serving_holds():
    assert kv_budget_bytes(free_bytes=1000, utilization=0.9, activation_bytes=100, reserved_bytes=50) == 750
