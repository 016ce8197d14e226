"""Random workloads with every feature on together, checked against transformers after every step.

Prefix caching with the host tier, parallel samples, swap, recompute and auto preemption, partial
preemption, chunked prefill, tiny pools, a watermark, block sizes 1 to 32. After every step the
block invariants hold, no step writes into a block another sequence (or the prefix cache) still
uses, and every block the prefix cache names still holds the K/V it was named for. Greedy tokens
must equal transformers' ``generate``; seeded samples must equal the same request served alone in
a pool with room. ``KVLIB_FUZZ_EXAMPLES`` sets how many workloads run (CI runs a few dozen).
"""
import os
import random

import pytest
import torch
from checkpoints import hf_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.core.block_table import blocks_for
from kvlib.core.invariants import InvariantError, check_invariants
from kvlib.core.preemption import LatestArrivalPolicy, PreemptionCostModel

EXAMPLES = int(os.environ.get("KVLIB_FUZZ_EXAMPLES", "30"))
VOCAB = 96
_greedy_references: dict = {}


@pytest.fixture(scope="module")
def folder(checkpoint):
    return checkpoint("llama-gqa")


@st.composite
def workloads(draw):
    rng = random.Random(draw(st.integers(0, 2**32)))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 32]))
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 24))] for _ in range(2)]
    prompts, params = [], []
    for _ in range(draw(st.integers(1, 6))):
        prompts.append(rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))])
        sampled = draw(st.booleans()) and draw(st.booleans())  # a quarter sample, the rest are greedy
        params.append(SamplingParams(max_tokens=draw(st.integers(1, 12)), n=draw(st.sampled_from([1, 1, 2, 3])),
                                     temperature=1.0 if sampled else 0.0, seed=rng.randrange(1000)))
    watermark = draw(st.sampled_from([0.0, 0.0, 0.05, 0.1, 0.25]))
    full = max(blocks_for(len(p) + sp.max_tokens, block_size) for p, sp in zip(prompts, params))
    prompt = max(blocks_for(len(p), block_size) for p in prompts)
    least = max(full, 1 + prompt)
    num_gpu_blocks = draw(st.integers(least, least * 2 + 2))
    while prompt > num_gpu_blocks - int(watermark * num_gpu_blocks):  # every prompt must be admissible
        num_gpu_blocks += 1
    num_cpu_blocks = draw(st.sampled_from([0, 4, 16, 64]))
    prefix_caching = draw(st.booleans())
    mode = draw(st.sampled_from(["swap", "recompute", "auto"]))
    config = EngineConfig(
        block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, preemption_mode=mode,
        partial_preemption=draw(st.booleans()), enable_prefix_caching=prefix_caching,
        host_prefix_cache=prefix_caching and num_cpu_blocks > 0 and draw(st.booleans()),
        max_num_seqs=draw(st.integers(max(sp.n for sp in params), 8)),
        max_num_batched_tokens=draw(st.sampled_from([1, 2, 3, 5, 8, 16, 64])), watermark=watermark)
    # In auto mode a cost model where either option can win, so both run.
    cost = PreemptionCostModel(host_link_bytes_per_s=10 ** draw(st.integers(2, 6)), prefill_tokens_per_s=100.0)
    return prompts, params, config, cost


class StepChecks:
    """The extra checks, wrapped around the engine's model runner."""

    def __init__(self, llm):
        self.engine = llm.engine
        self.fingerprints: dict = {}
        runner = self.engine.runner
        forward = runner.forward

        def checked_forward(plan):
            self.no_shared_writes(plan)
            return forward(plan)
        runner.forward = checked_forward

    def no_shared_writes(self, plan) -> None:
        bm = self.engine.block_manager
        for seq, num_new in plan.scheduled:
            first = seq.num_computed_tokens // bm.block_size
            last = blocks_for(seq.num_computed_tokens + num_new, bm.block_size)
            for block in seq.block_table.blocks[first:last]:
                if bm.sharers(block) != 1 or (bm.cache is not None and block in bm.cache):
                    raise InvariantError(f"sequence {seq.seq_id} writes into block {block}, which others use")

    def cached_blocks_unchanged(self) -> None:
        bm, runner = self.engine.block_manager, self.engine.runner
        tiers = [("device", bm.cache, runner.device_pool), ("host", bm.host_tier, runner.host_pool)]
        for name, tier, pool in tiers:
            for entry in tier or ():
                key = (name, entry.block_id, entry.name)
                data = pool.data[entry.block_id]
                if key not in self.fingerprints:
                    self.fingerprints[key] = data.clone()
                elif not torch.allclose(self.fingerprints[key], data, rtol=0, atol=1e-5):  # recomputed the same: equal
                    raise InvariantError(f"{name} block {entry.block_id}, cached for its prefix, changed its K/V")
        live = {(name, entry.block_id, entry.name) for name, tier, _ in tiers for entry in tier or ()}
        self.fingerprints = {k: v for k, v in self.fingerprints.items() if k in live}


def serve(llm, prompts, params):
    checks = StepChecks(llm)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        llm.engine.add_request(f"r{i}", prompt, p)
    done = {}
    for _ in range(20_000):
        if not llm.engine.has_unfinished_requests():
            break
        done.update((o.request_id, [s.token_ids for s in o.samples]) for o in llm.engine.step() if o.finished)
        check_invariants(llm.engine)
        checks.cached_blocks_unchanged()
    else:
        raise AssertionError("requests still unfinished after 20,000 steps")
    return [done[f"r{i}"] for i in range(len(prompts))]


def expected_tokens(folder, prompts, params, block_size):
    """transformers for greedy requests; the request alone in a roomy pool for seeded samples."""
    out = []
    for prompt, p in zip(prompts, params):
        if p.greedy:
            key = (tuple(prompt), p.max_tokens)
            if key not in _greedy_references:
                _greedy_references[key] = hf_greedy(folder, prompt, p.max_tokens)
            out.append([_greedy_references[key]] * p.n)
        else:
            alone = LLM(folder, EngineConfig(block_size=block_size, num_gpu_blocks=512), verbose=False)
            out.append([s.token_ids for s in alone.generate([prompt], p)[0].samples])
    return out


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
@given(workload=workloads())
def test_every_feature_together(folder, workload):
    prompts, params, config, cost = workload
    llm = LLM(folder, config, preemption_policy=LatestArrivalPolicy(cost), verbose=False)
    assert serve(llm, prompts, params) == expected_tokens(folder, prompts, params, config.block_size)
