"""Under memory pressure the engine preempts; greedy outputs must not change, in every mode."""
import logging
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.core.preemption import LatestArrivalPolicy, PreemptionCostModel
from kvlib.core.invariants import serve_checked

MODES = [("recompute", False), ("swap", False), ("recompute", True), ("swap", True)]


def run_steps(llm, prompts, params):
    """Drive the step-level API, checking invariants after every step; return tokens by request."""
    return [out.token_ids for out in serve_checked(llm, prompts, params, max_steps=100_000)]


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(1)
    prompts = [[rng.randrange(96) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    params = [SamplingParams(max_tokens=rng.randint(5, 25)) for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module")
def unpressured(checkpoint, workload):
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=1024), verbose=False)
    return llm.generate(*workload)


@pytest.mark.parametrize("mode, partial", MODES)
def test_outputs_unchanged_under_pressure(mode, partial, checkpoint, workload, unpressured):
    config = EngineConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=64, preemption_mode=mode,
                          partial_preemption=partial, watermark=0.0)
    llm = LLM(checkpoint("llama-gqa"), config, verbose=False)
    assert run_steps(llm, *workload) == [o.token_ids for o in unpressured]
    m = llm.metrics
    assert m.num_preemptions > 0
    if mode == "swap":
        assert m.num_preemptions_swap == m.num_preemptions and m.num_swapped_out_blocks == m.num_swapped_in_blocks > 0
        assert m.swap_bytes == (m.num_swapped_out_blocks + m.num_swapped_in_blocks) * llm.engine.runner.spec.block_bytes
    else:
        assert m.num_preemptions_recompute == m.num_preemptions and m.num_recomputed_tokens > 0
    assert sum(r.num_preemptions for r in m.requests.values()) == m.num_preemptions


def test_full_host_pool_falls_back_to_recompute(checkpoint, workload, unpressured):
    config = EngineConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=2, preemption_mode="swap", watermark=0.0)
    llm = LLM(checkpoint("llama-gqa"), config, verbose=False)
    assert run_steps(llm, *workload) == [o.token_ids for o in unpressured]
    assert llm.metrics.num_swap_fallbacks > 0 and llm.metrics.num_preemptions_recompute > 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_workloads_and_pools(data, checkpoint):
    mode, partial = data.draw(st.sampled_from(MODES))
    block_size = data.draw(st.sampled_from([1, 2, 4, 8]))
    lengths = data.draw(st.lists(st.tuples(st.integers(1, 24), st.integers(1, 16)), min_size=1, max_size=6))
    rng = random.Random(data.draw(st.integers(0, 1000)))
    prompts = [[rng.randrange(96) for _ in range(p)] for p, _ in lengths]
    params = [SamplingParams(max_tokens=m) for _, m in lengths]
    need = max(-(-(p + m) // block_size) for p, m in lengths)
    num_gpu_blocks = data.draw(st.integers(need, need * 3))
    folder = checkpoint("llama-gqa")
    reference = LLM(folder, EngineConfig(block_size=block_size, num_gpu_blocks=4096), verbose=False)
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    config = EngineConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=data.draw(st.integers(0, 64)),
                          preemption_mode=mode, partial_preemption=partial, watermark=0.0)
    assert run_steps(LLM(folder, config, verbose=False), prompts, params) == expected


@pytest.mark.parametrize("link, prefill, expected", [(1e3, 1e9, "recompute"), (1e15, 1.0, "swap")])
def test_auto_mode_follows_the_cost_model(link, prefill, expected, checkpoint, workload, unpressured):
    """Auto picks per victim the cheaper option; outputs stay the same whichever it picks."""
    policy = LatestArrivalPolicy(PreemptionCostModel(host_link_bytes_per_s=link, prefill_tokens_per_s=prefill))
    config = EngineConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=64, preemption_mode="auto", watermark=0.0)
    llm = LLM(checkpoint("llama-gqa"), config, preemption_policy=policy, verbose=False)
    assert run_steps(llm, *workload) == [o.token_ids for o in unpressured]
    m = llm.metrics
    assert m.num_preemptions > 0
    assert getattr(m, f"num_preemptions_{expected}") == m.num_preemptions


def test_auto_mode_measures_its_constants(checkpoint, workload, unpressured):
    config = EngineConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=64, preemption_mode="auto", watermark=0.0)
    llm = LLM(checkpoint("llama-gqa"), config, verbose=False)
    cost = llm.engine.cost_model
    assert cost.host_link_bytes_per_s > 0 and cost.prefill_tokens_per_s > 0
    assert run_steps(llm, *workload) == [o.token_ids for o in unpressured]


def test_recompute_time_is_charged(checkpoint, workload):
    config = EngineConfig(block_size=4, num_gpu_blocks=16, preemption_mode="recompute", watermark=0.0)
    llm = LLM(checkpoint("llama-gqa"), config, verbose=False)
    llm.generate(*workload)
    assert llm.metrics.num_recomputed_tokens > 0 and llm.metrics.recompute_time > 0


def test_oversubscription_warns_once(checkpoint, caplog):
    config = EngineConfig(block_size=2, num_gpu_blocks=24, max_num_seqs=16, preemption_mode="recompute", watermark=0.0)
    llm = LLM(checkpoint("llama-gqa"), config, verbose=False)
    with caplog.at_level(logging.WARNING, logger="kvlib"):
        llm.generate([[1, 2, 3, 4]] * 16, SamplingParams(max_tokens=30))
    warnings = [r.message for r in caplog.records if "oversubscribed" in r.message]
    assert llm.metrics.num_preemptions / llm.metrics.num_finished > 1.0
    assert len(warnings) == 1 and "num_gpu_blocks" in warnings[0] and "max_num_seqs" in warnings[0]


def test_no_oversubscription_warning_with_room(checkpoint, caplog):
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=2, num_gpu_blocks=1024), verbose=False)
    with caplog.at_level(logging.WARNING, logger="kvlib"):
        llm.generate([[1, 2, 3, 4]] * 16, SamplingParams(max_tokens=30))
    assert llm.metrics.num_preemptions == 0 and not caplog.records


def test_a_sequence_that_gave_up_its_own_tail_resumes_from_the_cached_block_with_the_same_tokens(checkpoint):
    """b is its own victim (a already ran this step) and lets its full third block go; the prefix cache keeps
    it, so b resumes after it: one token computed, not five, and the tokens are those of a roomy pool."""
    prompts, params = [[34, 43], list(range(8))], [SamplingParams(max_tokens=6), SamplingParams(max_tokens=10)]
    roomy = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=64), verbose=False)
    config = EngineConfig(block_size=4, num_gpu_blocks=5, preemption_mode="recompute", partial_preemption=True,
                          enable_prefix_caching=True, watermark=0.0)
    llm = LLM(checkpoint("llama-gqa"), config, verbose=False)
    assert run_steps(llm, prompts, params) == [o.token_ids for o in roomy.generate(prompts, params)]
    assert (llm.metrics.num_preemptions_recompute, llm.metrics.num_recomputed_tokens) == (1, 4)
    assert [s.num_batched_tokens for s in llm.metrics.timeline] == [10, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1]
