"""The seed lesson's walk-through, run on the real engine.

GPU KV pool fully used; request C needs 200 blocks, none free; request A holds 300 unshared
blocks and is the newest, so it is preempted. C runs, and A finishes with unchanged output.

How the engine gets there (block size 1, so blocks are tokens; at most 201 tokens a step):
A (299-token prompt) is prefilled alone; C, which arrived earlier but reached the engine later,
then takes the last 200 blocks for the first chunk of its 400-token prompt while A's decode
takes block 300. The next step C needs 200 more blocks for the rest of its prompt, the pool is
full, and A, the newest running request, is the victim.
"""
import random
import time

import pytest

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.core.invariants import check_invariants

A_PROMPT, C_PROMPT = 299, 400


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [rng.randrange(96) for _ in range(A_PROMPT)], [rng.randrange(96) for _ in range(C_PROMPT)]


@pytest.fixture(scope="module")
def unpressured(checkpoint, prompts):
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=1, num_gpu_blocks=2000), verbose=False)
    return [o.token_ids for o in llm.generate(list(prompts), SamplingParams(max_tokens=8))]


def walk_through(folder, prompts, mode, partial):
    config = EngineConfig(block_size=1, num_gpu_blocks=500, num_cpu_blocks=500, preemption_mode=mode,
                          partial_preemption=partial, watermark=0.0, max_num_batched_tokens=201)
    llm = LLM(folder, config, verbose=False)
    engine, gpu = llm.engine, llm.engine.block_manager.device_pool
    params = SamplingParams(max_tokens=8)
    c_arrival = time.perf_counter()
    engine.add_request("A", prompts[0], params)
    engine.step()  # A's prefill, in chunks of at most 201 tokens: 201 ...
    engine.step()  # ... then 98, and A's first token
    engine.add_request("C", prompts[1], params, arrival_time=c_arrival)
    engine.step()  # A decodes into block 300; C's first chunk takes the last 200
    a, c = engine.scheduler.running[1], engine.scheduler.running[0]
    assert (a.request_id, c.request_id) == ("A", "C")
    assert len(a.block_table) == 300 and len(c.block_table) == 200 and gpu.num_free == 0
    assert c.num_uncomputed_tokens == 200 and c.block_table.num_missing_blocks(C_PROMPT) == 200
    engine.step()  # C needs 200 blocks: A is preempted
    at_preemption = llm.metrics.summary()
    results = {}
    while engine.has_unfinished_requests():
        results.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        check_invariants(engine)
    return at_preemption, llm.metrics, [results["A"], results["C"]]


def test_swap_moves_all_300_blocks_out_and_back(checkpoint, prompts, unpressured):
    first, m, outputs = walk_through(checkpoint("llama-gqa"), prompts, "swap", partial=False)
    assert first["num_swapped_out_blocks"] == 300 and first["peak_cpu_blocks_used"] == 300
    assert (m.num_preemptions_swap, m.num_swapped_out_blocks, m.num_swapped_in_blocks) == (1, 300, 300)
    assert m.requests["A"].num_preemptions == 1 and m.requests["C"].num_preemptions == 0
    assert outputs == unpressured


def test_recompute_frees_300_blocks_and_recomputes_a(checkpoint, prompts, unpressured):
    first, m, outputs = walk_through(checkpoint("llama-gqa"), prompts, "recompute", partial=False)
    assert first["num_recomputed_tokens"] == 300
    assert (m.num_preemptions_recompute, m.num_recomputed_tokens, m.num_swapped_out_blocks) == (1, 300, 0)
    assert outputs == unpressured


@pytest.mark.parametrize("mode, moved", [("swap", "num_swapped_out_blocks"), ("recompute", "num_recomputed_tokens")])
def test_partial_preemption_takes_only_the_200_needed(checkpoint, prompts, unpressured, mode, moved):
    first, m, outputs = walk_through(checkpoint("llama-gqa"), prompts, mode, partial=True)
    assert first[moved] == 200 and first["num_preemptions"] == 1
    # C's own decode later needs 7 more blocks: they too come from A's tail, a block at a time,
    # and each time A gives up a block counts as a preemption
    assert getattr(m, moved) == 207 and m.num_preemptions == m.requests["A"].num_preemptions == 8
    assert outputs == unpressured
