"""The memory benchmark's numbers agree with what the workload implies, computed independently."""
import statistics

import pytest

from kvlib.cli.bench.memory import (
    ContiguousScheme,
    PagedScheme,
    Request,
    kv_bytes_rows,
    next_power_of_two,
    run_memory_bench,
    serve,
)
from kvlib.cli.bench.report import format_table
from kvlib.cli.bench.workloads import sharegpt_like_lengths
from kvlib.core.block_table import blocks_for

NUM_REQUESTS, BLOCK_SIZE, MAX_LEN = 1000, 16, 2048
MEMORY_SLOTS = 32 * MAX_LEN


@pytest.fixture(scope="module")
def rows():
    return {r["scheme"]: r for r in run_memory_bench(NUM_REQUESTS, BLOCK_SIZE, seed=0, max_len=MAX_LEN,
                                                       memory_slots=MEMORY_SLOTS)}


def lifetime_waste(reserve) -> float:
    """1 - tokens/slots summed over every step of every sequence, when each keeps one reservation."""
    tokens = slots = 0
    for p, o in sharegpt_like_lengths(NUM_REQUESTS, seed=0, max_len=MAX_LEN):
        tokens += o * p + o * (o - 1) // 2  # holds p, p + 1, ..., p + o - 1 tokens over its o steps
        slots += o * reserve(p, o)
    return 1 - tokens / slots


def test_contiguous_waste_matches_the_reservations(rows):
    assert rows["contiguous, max_len"]["waste %"] == pytest.approx(100 * lifetime_waste(lambda p, o: MAX_LEN))
    tight = lifetime_waste(lambda p, o: min(p + next_power_of_two(o), MAX_LEN))
    assert rows["contiguous, prompt + max_tokens"]["waste %"] == pytest.approx(100 * tight)


def test_paged_waste_is_under_one_block_per_sequence(rows):
    paged = rows["paged"]
    unused_slots_per_sequence = paged["waste %"] / 100 * paged["slots/seq"]
    assert 0 < unused_slots_per_sequence < BLOCK_SIZE
    assert paged["waste %"] <= 4.0


def test_paged_waste_without_preemption_is_the_last_block_gap():
    lengths = sharegpt_like_lengths(200, seed=1, max_len=MAX_LEN)
    paged = run_memory_bench(200, BLOCK_SIZE, seed=1, max_len=MAX_LEN, memory_slots=200 * MAX_LEN)[0]
    assert paged["scheme"] == "paged" and paged["preemptions"] == 0
    tokens = sum(o * p + o * (o - 1) // 2 for p, o in lengths)
    slots = sum(blocks_for(p + k, BLOCK_SIZE) * BLOCK_SIZE for p, o in lengths for k in range(o))
    assert paged["waste %"] == pytest.approx(100 * (1 - tokens / slots))


def test_sequences_that_fit(rows):
    assert rows["contiguous, max_len"]["concurrent seqs"] == MEMORY_SLOTS // MAX_LEN  # memory full at every step
    assert rows["paged"]["x max_len"] >= 2.0
    assert rows["paged"]["concurrent seqs"] > rows["contiguous, prompt + max_tokens"]["concurrent seqs"]


def test_every_slot_is_returned_after_the_run():
    lengths = sharegpt_like_lengths(300, seed=2, max_len=MAX_LEN)
    paged = PagedScheme(16 * MAX_LEN, BLOCK_SIZE)
    assert serve(paged, lengths).preemptions > 0  # a small memory: the preemption path ran too
    assert paged.allocator.num_free == paged.allocator.num_blocks and not paged.tables
    contiguous = ContiguousScheme("c", 16 * MAX_LEN, lambda r: r.prompt + r.output)
    serve(contiguous, lengths)
    assert contiguous.free_runs == [(0, 16 * MAX_LEN)] and not contiguous.runs


def test_contiguous_first_fit_reuses_and_merges_holes():
    scheme = ContiguousScheme("c", 100, lambda r: r.prompt)
    a, b, c = Request(0, 30, 1), Request(1, 30, 1), Request(2, 30, 1)
    assert all(scheme.admit(r) for r in (a, b, c))
    assert not scheme.admit(Request(3, 20, 1))  # 10 slots left
    scheme.release(b)
    assert scheme.admit(Request(4, 20, 1)) and scheme.runs[4] == (30, 20)  # first fit: the hole b left
    scheme.release(a)
    scheme.release(c)
    assert scheme.free_runs == [(0, 30), (50, 50)]


def test_workload_is_seeded_bounded_and_chat_shaped():
    lengths = sharegpt_like_lengths(5000, seed=3, max_len=MAX_LEN)
    assert lengths == sharegpt_like_lengths(5000, seed=3, max_len=MAX_LEN)
    assert lengths != sharegpt_like_lengths(5000, seed=4, max_len=MAX_LEN)
    assert all(p >= 1 and o >= 1 and p + o <= MAX_LEN for p, o in lengths)
    assert 160 <= statistics.mean(p for p, _ in lengths) <= 200
    assert 200 <= statistics.mean(o for _, o in lengths) <= 340


def test_kv_bytes_per_token_of_llama3_8b():
    llama = next(r for r in kv_bytes_rows() if r["model"] == "Llama-3-8B")
    assert llama["KiB/token"] == 32 * 2 * 8 * 128 * 2 / 1024 == 128
    assert llama["KiB/token without GQA"] == 4 * llama["KiB/token"]


def test_format_table_aligns_columns():
    text = format_table([{"scheme": "a", "n": 1234, "x": 1.5}, {"scheme": "longer", "n": 7, "x": 10.25}], "T")
    title, header, rule, *body = text.splitlines()
    assert title == "T" and header.split() == ["scheme", "n", "x"]
    assert len({len(line) for line in [rule, *body]}) == 1
    assert body[0].split() == ["a", "1,234", "1.50"] and body[1].endswith("10.25")
