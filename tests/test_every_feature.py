"""Random workloads with every feature on together, checked against transformers after every step.

Prefix caching with the host tier, parallel samples, swap, recompute and auto preemption, partial
preemption, chunked prefill, tiny pools, a watermark, block sizes 1 to 32. After every step the
block invariants hold, no step writes into a block another sequence (or the prefix cache) still
uses, and every block the prefix cache names still holds the K/V it was named for. Greedy tokens
must equal transformers' ``generate``; seeded samples must equal the same request served alone in
a pool with room, or part from it at one draw that run won by a near tie (``NEAR_TIE``) against the
token taken here, and no earlier: a prompt prefilled in other chunks or beside other requests sums
its attention in another order, and float32 rounding (logits 1e-5 apart) can turn such a tie.
``KVLIB_FUZZ_EXAMPLES`` sets how many workloads run (CI runs a few dozen); ``KVLIB_FUZZ_TRITON_EXAMPLES`` how
many of them the Triton backend serves too (its kernels interpreted on a CPU, so CI runs a handful).
"""
import os
import random
from contextlib import contextmanager

import pytest
import torch
from checkpoints import hf_greedy
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.core.block_table import blocks_for
from kvlib.core.invariants import InvariantError, check_invariants
from kvlib.core.preemption import LatestArrivalPolicy, PreemptionCostModel
from kvlib.kernels import triton_available
from kvlib.runner import sampler

EXAMPLES = int(os.environ.get("KVLIB_FUZZ_EXAMPLES", "30"))
TRITON_EXAMPLES = int(os.environ.get("KVLIB_FUZZ_TRITON_EXAMPLES", "3"))
NEAR_TIE = 1e-4  # the best token of a draw beat the runner-up by less than this share of its race value
VOCAB = 96
_greedy_references: dict = {}


@pytest.fixture(scope="module")
def folder(checkpoint):
    return checkpoint("llama-gqa")


@st.composite
def workloads(draw, attention_backend: str = "torch"):
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
        max_num_batched_tokens=draw(st.sampled_from([1, 2, 3, 5, 8, 16, 64])), watermark=watermark,
        attention_backend=attention_backend)
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
                # Recomputed the same, but maybe in a chunk of another shape: a partially preempted sequence takes its
                # own just-released cached block back and recomputes it under the same name (1.1e-5 apart, float32).
                elif not torch.allclose(self.fingerprints[key], data, rtol=0, atol=1e-4):
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
    """transformers for greedy requests; the request alone in a roomy pool for seeded samples, with its races."""
    out = []
    for prompt, p in zip(prompts, params):
        if p.greedy:
            key = (tuple(prompt), p.max_tokens)
            if key not in _greedy_references:
                _greedy_references[key] = hf_greedy(folder, prompt, p.max_tokens)
            out.append(([_greedy_references[key]] * p.n, None))
        else:
            alone = LLM(folder, EngineConfig(block_size=block_size, num_gpu_blocks=512), verbose=False)
            with recorded_races() as races:
                samples = [s.token_ids for s in alone.generate([prompt], p)[0].samples]
            out.append((samples, races))
    return out


@contextmanager
def recorded_races():
    """Every seeded draw's two best tokens in the sampler's exponential race and how far apart their race values
    were (relative), by (sample index, position in the output)."""
    races, rows = {}, []
    sample, race = sampler.Sampler.sample, sampler.race

    def sampling(self, logits, seqs):
        rows[:] = seqs
        return sample(self, logits, seqs)

    def racing(*args):
        standing = race(*args)
        best = standing.topk(2, dim=-1)
        for seq, values, tokens in zip(rows, best.values.tolist(), best.indices.tolist()):
            if not seq.params.greedy:
                races[seq.sample_index, len(seq.output_token_ids)] = (tokens, (values[0] - values[1]) / values[0])
        return standing
    sampler.Sampler.sample, sampler.race = sampling, racing
    try:
        yield races
    finally:
        sampler.Sampler.sample, sampler.race = sample, race


def parted_at_a_tie(got: list[int], want: list[int], races: dict, sample: int) -> bool:
    """Whether sample ``sample``'s tokens equal the reference's up to one draw the reference won by a near tie
    against the token ``got`` took there (after it the two continue from different tokens)."""
    part = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if part is None:
        return len(got) == len(want)
    tokens, gap = races.get((sample, part), (None, 1.0))
    return tokens == [want[part], got[part]] and gap < NEAR_TIE


def assert_served_as_expected(served, expected) -> None:
    for request, (got, (want, races)) in enumerate(zip(served, expected)):
        if races is None:
            assert got == want, f"request {request}: greedy tokens differ from transformers'"
            continue
        assert len(got) == len(want)
        for sample, (tokens, reference) in enumerate(zip(got, want)):
            assert tokens == reference or parted_at_a_tie(tokens, reference, races, sample), \
                f"request {request} sample {sample}: {tokens} against {reference} served alone"


def test_a_sample_may_part_only_at_a_near_tie_against_the_token_it_took():
    races = {(0, 2): ([18, 26], 2e-6), (1, 1): ([5, 7], 0.3)}
    assert parted_at_a_tie([63, 87, 26], [63, 87, 18], races, 0)
    assert not parted_at_a_tie([63, 87, 40], [63, 87, 18], races, 0)  # not the runner-up
    assert not parted_at_a_tie([63, 7, 26], [63, 5, 18], races, 1)  # a clear win turned
    assert not parted_at_a_tie([1, 87, 26], [63, 87, 18], races, 0)  # parted before the tie
    assert not parted_at_a_tie([63, 87], [63, 87, 18], races, 0)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
@given(workload=workloads())
# Found by a 600-example run: sample 2's third token, a 2e-6 tie in the roomy run, turns with 2-token prefill chunks.
@example(workload=(
    [[56, 33, 71, 30, 74, 73, 12, 55, 64, 32, 9, 68, 58, 67, 70, 75, 83, 13, 86, 33, 35, 89, 15],
     [56, 33, 71, 30, 74, 73, 12, 55, 64, 32, 9, 68, 58, 67, 70, 75, 83, 13, 86, 33, 35, 89, 76, 78, 39, 67]],
    [SamplingParams(max_tokens=1, temperature=0.0, seed=494), SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=480)],
    EngineConfig(block_size=1, num_gpu_blocks=29, num_cpu_blocks=0, preemption_mode="swap", max_num_seqs=3,
                 max_num_batched_tokens=2, watermark=0.0),
    PreemptionCostModel(host_link_bytes_per_s=100, prefill_tokens_per_s=100.0)))
def test_every_feature_together(folder, workload):
    prompts, params, config, cost = workload
    llm = LLM(folder, config, preemption_policy=LatestArrivalPolicy(cost), verbose=False)
    assert_served_as_expected(serve(llm, prompts, params), expected_tokens(folder, prompts, params, config.block_size))


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
@settings(max_examples=TRITON_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                              HealthCheck.too_slow])
@given(workload=workloads(attention_backend="triton"))
def test_every_feature_together_on_the_triton_kernels(folder, workload):
    """The same workloads served by the Triton backend: its decode, prefill, K/V store and block-copy kernels
    under preemption, prefix caching with the host tier, forks and chunked prefill, against the same references
    (seeded samples against the torch backend's run alone)."""
    prompts, params, config, cost = workload
    llm = LLM(folder, config, preemption_policy=LatestArrivalPolicy(cost), verbose=False)
    assert llm.engine.runner.backend.name == "triton"
    assert_served_as_expected(serve(llm, prompts, params), expected_tokens(folder, prompts, params, config.block_size))
