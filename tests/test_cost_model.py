"""The preemption cost model against hand-computed prices, and its crossover against a brute-force scan."""
import random

import pytest

from kvlib.core.cost_model import PreemptionCostModel, attention_pairs
from kvlib.core.preemption import LatestArrivalPolicy, PreemptionContext

BLOCK, BLOCK_BYTES = 16, 368_640


def brute_force_range(cost, batch, limit_tokens):
    recomputed = [b * BLOCK for b in range(1, limit_tokens // BLOCK + 1)
                  if cost.choose(b, BLOCK_BYTES, b * BLOCK, batch) == "recompute"]
    return (recomputed[0], recomputed[-1]) if recomputed else None


def test_attention_pairs_counts_causal_and_cached_pairs():
    assert attention_pairs(1) == 1
    assert attention_pairs(4) == 1 + 2 + 3 + 4
    assert attention_pairs(3, num_cached=10) == 11 + 12 + 13


@pytest.mark.parametrize("batch", [1, 7, 300])
def test_two_speeds_give_the_plain_prices(batch):
    """Given only the link and the prefill speed: bytes over the link twice, tokens over the prefill speed."""
    cost = PreemptionCostModel(host_link_bytes_per_s=2048, prefill_tokens_per_s=3.5)
    assert cost.swap_seconds(3, 1000) == pytest.approx(2 * 3 * 1000 / 2048)
    assert cost.recompute_seconds(10, batch) == pytest.approx(10 / 3.5)
    assert cost.swap_seconds(0, 1000) == cost.recompute_seconds(0, batch) == 0.0


def test_a_pass_takes_the_longer_of_reads_and_arithmetic_with_full_overlap_and_their_sum_with_none():
    roofline = PreemptionCostModel(1e9, prefill_tokens_per_s=1000.0, floor_seconds=0.1, overlap=1.0)
    assert roofline.pass_seconds(50) == pytest.approx(0.1)
    assert roofline.pass_seconds(300) == pytest.approx(0.3)
    additive = PreemptionCostModel(1e9, prefill_tokens_per_s=1000.0, floor_seconds=0.1, overlap=0.0)
    assert additive.pass_seconds(50) == pytest.approx(0.15)
    half = PreemptionCostModel(1e9, prefill_tokens_per_s=1000.0, floor_seconds=0.1, overlap=0.5)
    assert half.pass_seconds(50) == pytest.approx(0.1 + 0.05 - 0.025)
    with_attention = PreemptionCostModel(1e9, 1000.0, 0.1, 1.0, attention_seconds_per_pair=1e-6,
                                         attention_call_seconds=0.01)
    assert with_attention.pass_seconds(50, num_pairs=2000, num_prefills=2) == pytest.approx(0.1 + 0.002 + 0.02)


def test_recompute_below_the_knee_costs_only_its_attention():
    """A batch of 10 tokens on a pass that hides 100 under its weight reads: 40 more add only attention."""
    cost = PreemptionCostModel(1e9, prefill_tokens_per_s=1000.0, floor_seconds=0.1, overlap=1.0,
                               attention_seconds_per_pair=1e-6, attention_call_seconds=0.003)
    assert cost.recompute_seconds(40, batch_tokens=10) == pytest.approx(attention_pairs(40) * 1e-6 + 0.003)
    # past the knee every token pays its arithmetic: 10 + 140 tokens -> 0.15 s against the floor's 0.1
    assert cost.recompute_seconds(140, batch_tokens=10) == pytest.approx(0.05 + attention_pairs(140) * 1e-6 + 0.003)
    # a batch past the knee already: every victim token pays
    assert cost.recompute_seconds(40, batch_tokens=200) == pytest.approx(0.04 + attention_pairs(40) * 1e-6 + 0.003)


def test_swap_pays_a_call_per_copy_each_way():
    cost = PreemptionCostModel(host_link_bytes_per_s=1e9, prefill_tokens_per_s=1.0, copy_call_seconds=1e-4)
    assert cost.swap_seconds(5, 1000) == pytest.approx(2 * (1e-4 + 5 * 1000 / 1e9))


def test_a_tie_recomputes():
    cost = PreemptionCostModel(host_link_bytes_per_s=2.0, prefill_tokens_per_s=1.0)
    assert cost.swap_seconds(1, 1) == cost.recompute_seconds(1) and cost.choose(1, 1, 1) == "recompute"


def test_recompute_range_ends():
    assert PreemptionCostModel(1e15, 1.0).recompute_range(BLOCK, BLOCK_BYTES, limit_tokens=4096) is None
    assert PreemptionCostModel(1e3, 1e9).recompute_range(BLOCK, BLOCK_BYTES, limit_tokens=4096) == (16, 4096)
    assert PreemptionCostModel(1e3, 1e9).recompute_range(BLOCK, BLOCK_BYTES, limit_tokens=8) is None


def test_recompute_range_of_a_single_block():
    """Only the one-block victim recomputes (attention grows past two copy calls at two blocks), and a limit of one
    block still has its one length."""
    only_one = PreemptionCostModel(1e18, 1e9, attention_seconds_per_pair=1e-3, copy_call_seconds=0.15)
    assert only_one.recompute_range(BLOCK, BLOCK_BYTES, limit_tokens=4096) == (16, 16) \
        == brute_force_range(only_one, 1, 4096)
    assert PreemptionCostModel(1e3, 1e9).recompute_range(BLOCK, BLOCK_BYTES, limit_tokens=BLOCK) == (16, 16)


def test_recompute_range_in_the_middle():
    """Attention calls dearer than two copy calls: the shortest victims swap, the middle recompute, the longest swap."""
    cost = PreemptionCostModel(50e9, 1.8e6, floor_seconds=3e-3, overlap=1.0, attention_seconds_per_pair=1.75e-10,
                               attention_call_seconds=4e-4, copy_call_seconds=3e-5)
    span = cost.recompute_range(BLOCK, BLOCK_BYTES, 1, 1 << 15)
    assert span == brute_force_range(cost, 1, 1 << 15)
    assert span[0] > BLOCK and span[1] < 1 << 15


@pytest.mark.parametrize("seed", range(40))
def test_recompute_range_matches_a_brute_force_scan(seed):
    rng = random.Random(seed)
    cost = PreemptionCostModel(
        host_link_bytes_per_s=10 ** rng.uniform(8, 12), prefill_tokens_per_s=10 ** rng.uniform(2, 7),
        floor_seconds=rng.choice([0.0, 10 ** rng.uniform(-5, -1)]), overlap=rng.random(),
        attention_seconds_per_pair=rng.choice([0.0, 10 ** rng.uniform(-11, -6)]),
        attention_call_seconds=rng.choice([0.0, 10 ** rng.uniform(-6, -2)]),
        copy_call_seconds=rng.choice([0.0, 10 ** rng.uniform(-6, -3)]))
    batch = rng.choice([1, 4, 64, 512])
    assert cost.recompute_range(BLOCK, BLOCK_BYTES, batch, 8192) == brute_force_range(cost, batch, 8192)


def test_the_default_policy_prices_recompute_in_the_batch_the_context_names():
    """Below the knee a small batch recomputes; a batch already past it makes every token pay, so it swaps."""
    cost = PreemptionCostModel(host_link_bytes_per_s=50e9, prefill_tokens_per_s=30_000.0, floor_seconds=5e-3)
    policy = LatestArrivalPolicy(cost)

    def context(batch_tokens):
        return PreemptionContext(num_blocks=4, num_tokens=64, num_host_blocks=4, block_bytes=2 * 2**20,
                                 host_free_blocks=100, batch_tokens=batch_tokens)
    assert policy.choose_mode(None, context(1)) == "recompute"
    assert policy.choose_mode(None, context(256)) == "swap"
    assert PreemptionContext(1, 16, 1, 100, 10).batch_tokens == 1
