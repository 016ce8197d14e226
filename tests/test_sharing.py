"""Copy-on-write sharing: parallel samples share their prompt, prefix caching shares across requests."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.core.invariants import serve_checked


def run_steps(llm, prompts, params):
    """Drive the step-level API, checking invariants after every step; return each sample's tokens."""
    return [[s.token_ids for s in out.samples] for out in serve_checked(llm, prompts, params, max_steps=100_000)]


@pytest.fixture(scope="module")
def folder(checkpoint):
    return checkpoint("llama-gqa")


PROMPTS = [[7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 3, 3], [11, 12, 13, 14, 15, 16]]


def test_greedy_samples_all_equal_the_single_output(folder):
    config = EngineConfig(block_size=4, num_gpu_blocks=256)
    single = LLM(folder, config, verbose=False).generate(PROMPTS, SamplingParams(max_tokens=12))
    llm = LLM(folder, config, verbose=False)
    outs = run_steps(llm, PROMPTS, [SamplingParams(max_tokens=12, n=4)] * 2)
    for out, one in zip(outs, single):
        assert out == [one.token_ids] * 4
    assert llm.metrics.num_cow_copies > 0  # the 13- and 6-token prompts end mid-block
    assert llm.metrics.summary()["peak_blocks_saved_by_sharing"] >= 3 * (13 // 4)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_seeded_samples_have_streams_of_their_own(folder, block_size):
    """Sample 0 of a request seeded s draws like an n=1 request seeded s; no two samples share a stream."""
    config = EngineConfig(block_size=block_size, num_gpu_blocks=512)
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, n=2) for s in (0, 1, 2)]
    prompt = PROMPTS[0]
    shared = run_steps(LLM(folder, config, verbose=False), [prompt] * 3, params)
    single = LLM(folder, config, verbose=False).generate(
        [prompt] * 3, [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in (0, 1, 2)])
    assert [samples[0] for samples in shared] == [o.token_ids for o in single]
    streams = [tuple(sample) for samples in shared for sample in samples]
    assert len(set(streams)) == 6, "requests seeded 0, 1, 2 with n=2 must give six different streams"


@pytest.mark.parametrize("mode, partial", [("recompute", False), ("swap", False), ("swap", True), ("recompute", True)])
def test_parallel_samples_under_preemption(folder, mode, partial):
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=5, n=3) for _ in range(4)]
    prompts = [[i, i + 1, i + 2, i + 3, i + 4] for i in range(4)]
    expected = run_steps(LLM(folder, EngineConfig(block_size=2, num_gpu_blocks=1024), verbose=False), prompts, params)
    config = EngineConfig(block_size=2, num_gpu_blocks=40, num_cpu_blocks=200, preemption_mode=mode,
                          partial_preemption=partial, watermark=0.0)
    llm = LLM(folder, config, verbose=False)
    assert run_steps(llm, prompts, params) == expected
    assert llm.metrics.num_preemptions > 0


def test_prefix_cache_hits_and_identical_outputs(folder):
    system = list(range(40, 72))  # a 32-token shared prefix: 8 full blocks of 4
    prompts = [system + [i, i + 1, i + 2] for i in range(5)]
    params = [SamplingParams(max_tokens=8)] * 5
    plain = run_steps(LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=256), verbose=False), prompts, params)
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=256, enable_prefix_caching=True, max_num_seqs=1),
              verbose=False)
    assert run_steps(llm, prompts, params) == plain
    m = llm.metrics
    assert m.prefix_cache_queried_tokens == sum(len(p) for p in prompts)
    assert m.prefix_cache_hit_tokens == 4 * 32  # every request after the first reuses the 8 prefix blocks


def test_prefix_cache_verifies_tokens_not_only_the_hash(folder, monkeypatch):
    for module in ("kvlib.core.prefix_cache", "kvlib.core.block_manager"):  # every block's name collides
        monkeypatch.setattr(f"{module}.block_hash", lambda previous, tokens: 0)
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=64, enable_prefix_caching=True), verbose=False)
    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2))
    bm = llm.engine.block_manager
    assert len(bm.cached_prefix([1, 2, 3, 4, 5])) == 1
    assert bm.cached_prefix([9, 9, 9, 9, 5]) == []


def test_evicts_least_recently_used_cached_blocks(folder):
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=12, enable_prefix_caching=True, watermark=0.0),
              verbose=False)
    first, second = list(range(8)) + [50], list(range(10, 18)) + [50]
    llm.generate([first], SamplingParams(max_tokens=1))
    llm.generate([second], SamplingParams(max_tokens=1))
    bm = llm.engine.block_manager
    assert bm.cache.num_cached == 4 and bm.cache.num_evictable == 4
    llm.generate([list(range(20, 56)) + [50]], SamplingParams(max_tokens=1))  # 10 blocks: 8 free + 2 evicted
    assert bm.cached_prefix(first) == [] and len(bm.cached_prefix(second)) == 2


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_shared_prefix_workloads(data, folder):
    rng = random.Random(data.draw(st.integers(0, 10_000)))
    block_size = data.draw(st.sampled_from([1, 2, 4]))
    prefixes = [[rng.randrange(96) for _ in range(rng.randint(0, 12))] for _ in range(2)]
    prompts = [rng.choice(prefixes) + [rng.randrange(96) for _ in range(rng.randint(1, 6))] for _ in range(6)]
    params = [SamplingParams(max_tokens=rng.randint(1, 10), n=data.draw(st.sampled_from([1, 1, 2]))) for _ in prompts]
    expected = run_steps(LLM(folder, EngineConfig(block_size=block_size, num_gpu_blocks=2048), verbose=False),
                         prompts, params)
    config = EngineConfig(block_size=block_size, num_gpu_blocks=data.draw(st.integers(48 // block_size, 200)),
                          num_cpu_blocks=64, enable_prefix_caching=True, watermark=0.0,
                          host_prefix_cache=data.draw(st.booleans()),
                          preemption_mode=data.draw(st.sampled_from(["recompute", "swap"])),
                          partial_preemption=data.draw(st.booleans()))
    assert run_steps(LLM(folder, config, verbose=False), prompts, params) == expected


def test_host_tier_brings_an_evicted_prefix_back(folder):
    """Tiered caching: a returning conversation copies its prefix back from the host pool."""
    conversation = [(7 * i) % 90 + 3 for i in range(48)]  # 12 full blocks of 4
    others = [[(5 * i + j) % 90 + 3 for i in range(40)] for j in range(3)]
    returning = conversation + [1, 2, 3]
    params = SamplingParams(max_tokens=4)

    def serve(**extra):
        config = EngineConfig(block_size=4, num_gpu_blocks=20, watermark=0.0, max_num_seqs=1, **extra)
        llm = LLM(folder, config, verbose=False)
        tokens = run_steps(llm, [conversation, *others, returning], [params] * 5)
        return tokens, llm.metrics

    plain, _ = serve()
    device_only, m_device = serve(enable_prefix_caching=True)
    tiered, m_tiered = serve(enable_prefix_caching=True, host_prefix_cache=True, num_cpu_blocks=64)
    assert device_only == plain and tiered == plain
    assert m_device.prefix_cache_hit_tokens == 0  # the 20-block pool forgot the conversation
    assert m_tiered.prefix_cache_host_hit_tokens == 48 and m_tiered.prefix_cache_hit_tokens == 48


def test_host_tier_needs_prefix_caching_and_a_host_pool():
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True and num_cpu_blocks > 0"):
        EngineConfig(host_prefix_cache=True, enable_prefix_caching=True)


def test_host_tier_hit_survives_evictions_during_its_own_admission(folder):
    """Copying a hit back takes device blocks, whose eviction fills the host tier: the hit must stay."""
    rng = random.Random(0)
    conversation = [rng.randrange(3, 90) for _ in range(32)]
    config = EngineConfig(block_size=4, num_gpu_blocks=12, watermark=0.0, max_num_seqs=1, enable_prefix_caching=True,
                          host_prefix_cache=True, num_cpu_blocks=8)
    llm = LLM(folder, config, verbose=False)
    prompts = [conversation, [rng.randrange(3, 90) for _ in range(40)], conversation + [5, 6, 7, 8, 9, 10, 11, 12]]
    expected = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=64), verbose=False).generate(
        prompts, SamplingParams(max_tokens=1))
    assert run_steps(llm, prompts, [SamplingParams(max_tokens=1)] * 3) == [[o.token_ids] for o in expected]
    assert llm.metrics.prefix_cache_host_hit_tokens > 0


def test_a_finished_prefix_is_evicted_tail_first(folder):
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=16, enable_prefix_caching=True, watermark=0.0),
              verbose=False)
    prefix = list(range(3, 35))  # 8 full blocks
    llm.generate([prefix + [1]], SamplingParams(max_tokens=1))
    llm.generate([list(range(40, 76)) + [1]], SamplingParams(max_tokens=1))  # 10 blocks: 8 free, 2 evicted
    assert len(llm.engine.block_manager.cached_prefix(prefix)) == 6  # the head survives, the tail went first
