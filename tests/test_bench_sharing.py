"""The sharing benchmark's numbers are consistent with each other, with the workload, and with the real engine."""
import pytest

from kvlib import LLM, SamplingParams
from kvlib.cli.bench.sharing import (PAPER_COLUMN, Request, as_separate, few_shot_requests, main, roomy_config,
                                 run_sharing_bench, sampling_requests, serve)
from kvlib.cli.bench.workloads import sharegpt_like_lengths

NUM_REQUESTS, BLOCK_SIZE, MAX_LEN = 60, 16, 1024
SAMPLES, PREFIXES = (2, 4, 6), (80, 341)


@pytest.fixture(scope="module")
def rows():
    return {r["workload"]: r for r in run_sharing_bench(NUM_REQUESTS, BLOCK_SIZE, seed=0, max_len=MAX_LEN,
                                                          samples=SAMPLES, prefix_lens=PREFIXES)}


def test_sharing_saves_blocks_and_more_with_more_samples(rows):
    savings = []
    for n in SAMPLES:
        row = rows[f"parallel sampling, n={n}"]
        assert row["mean shared"] < row["mean separate"] and row["peak shared"] <= row["peak separate"]
        assert row["saving %"] > 0
        savings.append(row["saving %"])
    assert savings == sorted(savings)


def test_parallel_samples_prefill_once_and_copy_each_mid_block_prompt_end_once(rows):
    mid_block = sum(1 for p, _ in sharegpt_like_lengths(NUM_REQUESTS, 0, MAX_LEN) if p % BLOCK_SIZE)
    for n in SAMPLES:
        row = rows[f"parallel sampling, n={n}"]
        assert row["prefill saved %"] == pytest.approx(100 * (1 - 1 / n))
        assert row["CoW copies"] == (n - 1) * mid_block  # every sample but the last to write copies the shared tail
        assert row["prefix hit tokens"] == 0


def test_prefix_caching_hits_every_full_prefix_block_after_the_first_request(rows):
    for prefix_len in PREFIXES:
        row = rows[f"few-shot, {prefix_len}-token prefix"]
        assert row["prefix hit tokens"] == (NUM_REQUESTS - 1) * (prefix_len // BLOCK_SIZE * BLOCK_SIZE)
        assert row["saving %"] > 0 and row["peak shared"] <= row["peak separate"]
        assert row["CoW copies"] == 0
    longer, shorter = (rows[f"few-shot, {p}-token prefix"]["saving %"] for p in (341, 80))
    assert longer > shorter


def test_shared_tables_hold_what_separate_requests_hold_in_fewer_blocks():
    """Step for step, the same work: the shared run's table entries are the separate run's blocks."""
    requests = sampling_requests(30, n=3, seed=1, max_len=512)
    shared, separate = serve(requests), serve(as_separate(requests))
    assert shared.table_entries == separate.blocks == separate.table_entries
    assert all(s <= e for s, e in zip(shared.blocks, separate.blocks))
    assert shared.preemptions == separate.preemptions == 0


def test_few_shot_prompts_share_only_the_prefix():
    requests = few_shot_requests(5, prefix_len=40, seed=2, max_len=300)
    assert all(r.prompt[:40] == list(range(40)) for r in requests)
    suffixes = [t for r in requests for t in r.prompt[40:]]
    assert len(suffixes) == len(set(suffixes)) and min(suffixes) >= 40
    assert all(len(r.prompt) + r.max_tokens <= 300 for r in requests)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_block_accounting_matches_the_real_engine(prefix_caching):
    """The benchmark's scheduler loop reproduces the engine's per-step blocks, copies and cache hits."""
    prefix = [50 + t for t in range(9)] if prefix_caching else []
    requests = [Request(prefix + [(7 * i + t) % 250 + 3 for t in range(3 + 2 * i)], 4 + i, 1 if prefix_caching else 3, i)
                for i in range(5)]
    usage = serve(requests, block_size=4, prefix_caching=prefix_caching)
    llm = LLM("default", roomy_config(requests, 4, prefix_caching), verbose=False)
    engine, step = llm.engine, 0
    while step < len(requests) or engine.has_unfinished_requests():
        if step < len(requests):
            r = requests[step]
            engine.add_request(f"r{step}", r.prompt, SamplingParams(max_tokens=r.max_tokens, n=r.n, ignore_eos=True),
                               arrival_time=float(step))
        engine.step()
        step += 1
    timeline, m = llm.metrics.timeline, llm.metrics
    assert (m.num_cow_copies, m.prefix_cache_hit_tokens) == (usage.cow_copies, usage.prefix_hit_tokens)
    assert [r.blocks_saved_by_sharing for r in timeline] == [e - b for e, b in zip(usage.table_entries, usage.blocks)]
    if prefix_caching:  # the engine's block count also holds cached blocks nobody uses, so compare the hits
        assert usage.prefix_hit_tokens == 4 * 8  # requests 1-4 reuse the prefix's 2 full blocks
    else:
        assert [r.gpu_blocks_used for r in timeline] == usage.blocks and usage.cow_copies > 0


def test_main_prints_the_table_and_labels_the_papers_figures(capsys):
    assert main(["--num-requests", "12", "--max-len", "512"]) == 0
    out = capsys.readouterr().out
    for label in ["parallel sampling, n=2", "parallel sampling, n=6", "few-shot, 341-token prefix", PAPER_COLUMN,
                  "6.1-9.8% Alpaca, 16.2-30.5% ShareGPT", "not measured here"]:
        assert label in out
