"""Feature combinations that once gave wrong tokens, lost requests or stalled: one test each."""
import logging
import math
import random
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from kvlib import LLM, EngineConfig, SamplingParams, interfaces
from kvlib.attention.torch_backend import TorchAttentionBackend
from kvlib.core.block_allocator import BlockAllocator
from kvlib.core.invariants import check_invariants, serve_checked
from kvlib.core.preemption import LatestArrivalPolicy
from kvlib.core.prefix_cache import HostPrefixTier
from kvlib.core.sequence import SequenceStatus, sample_stream_seed
from kvlib.core.sharing import BlockSharing
from kvlib.interfaces import check_implements


@pytest.fixture(scope="module")
def folder(checkpoint):
    return checkpoint("llama-gqa")


def samples(outputs):
    return [[s.token_ids for s in out.samples] for out in outputs]


def roomy(folder, prompts, params, block_size):
    llm = LLM(folder, EngineConfig(block_size=block_size, num_gpu_blocks=4096), verbose=False)
    return samples(llm.generate(prompts, params))


def fuzzed_workload(seed: int, n_choices=(1,)):
    """The random shared-prefix workloads the regressions below were found with."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    prefixes = [[rng.randrange(96) for _ in range(rng.randint(0, 16))] for _ in range(2)]
    prompts = [rng.choice(prefixes) + [rng.randrange(96) for _ in range(rng.randint(1, 8))]
               for _ in range(rng.randint(2, 7))]
    params = [SamplingParams(max_tokens=rng.randint(1, 12), n=rng.choice(n_choices)) for _ in prompts]
    return block_size, prompts, params


# ---- wrong tokens ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, config", [
    (3, dict(block_size=2, num_gpu_blocks=14, num_cpu_blocks=7, preemption_mode="recompute", max_num_seqs=6,
             max_num_batched_tokens=4)),
    (8, dict(block_size=2, num_gpu_blocks=23, num_cpu_blocks=34, preemption_mode="recompute", max_num_seqs=5)),
    (19, dict(block_size=1, num_gpu_blocks=46, num_cpu_blocks=35, preemption_mode="swap", max_num_seqs=6)),
])
def test_a_prefix_block_demoted_and_hit_in_one_step_is_read_after_it_is_written(folder, seed, config):
    """Host tier: a cached block evicted to the host and hit by another request in the same step."""
    block_size, prompts, params = fuzzed_workload(seed)
    assert config["block_size"] == block_size
    llm = LLM(folder, EngineConfig(enable_prefix_caching=True, host_prefix_cache=True, watermark=0.0, **config),
              verbose=False)
    same_step = []
    execute_moves = llm.engine.runner.execute_moves

    def spy(moves):
        written = {host for _, host in moves.demote}
        same_step.extend(host for host, _ in moves.promote if host in written)
        return execute_moves(moves)
    llm.engine.runner.execute_moves = spy
    assert samples(serve_checked(llm, prompts, params, max_steps=5000)) == roomy(folder, prompts, params, block_size)
    assert same_step, "the workload no longer demotes and hits a block in one step"


def test_a_host_tier_smaller_than_one_steps_evictions_keeps_the_conversations_head(folder):
    """One long prompt evicts a whole 16-block conversation in one step into an 8-block tier. Evictions come tail
    first, and the tier, full of the tail, could drop none of it for the head (this step's copies held it): the
    returning turn found nothing on the host and recomputed all. Now the head is kept and copied back."""
    rng = random.Random(0)
    conversation, other = [rng.randrange(96) for _ in range(64)], [rng.randrange(96) for _ in range(72)]
    config = EngineConfig(block_size=4, num_gpu_blocks=20, num_cpu_blocks=8, watermark=0.0, enable_prefix_caching=True,
                          host_prefix_cache=True, max_num_batched_tokens=128)
    llm, params = LLM(folder, config, verbose=False), SamplingParams(max_tokens=4)
    reply = llm.generate([conversation], params)[0].token_ids
    llm.generate([other], SamplingParams(max_tokens=1))
    returning = conversation + reply + [rng.randrange(96) for _ in range(8)]
    before = llm.metrics.prefix_cache_host_hit_tokens
    assert samples(llm.generate([returning], params)) == roomy(folder, [returning], [params], 4)
    assert llm.metrics.prefix_cache_host_hit_tokens - before == 8 * 4  # the tier's 8 blocks: the first 32 tokens


def test_a_tier_raising_in_an_admission_leaves_the_sequence_as_it_came(folder):
    """A plugged-in tier raising as a returning prompt's host hit is copied back: the device hits the admission had
    taken stayed in the waiting sequence's table with nothing counted computed, and copy-on-write later let go of
    them past the prefix cache, which kept them cached and never evictable; the pool shrank until a prompt it
    could hold never ran."""
    class RaisesOnce(HostPrefixTier):
        armed = False

        def touch(self, name):
            if RaisesOnce.armed:
                RaisesOnce.armed = False
                raise RuntimeError("a bug in a plugged-in tier")
            super().touch(name)
    rng = random.Random(0)
    conversation, other = [rng.randrange(96) for _ in range(32)], [rng.randrange(96) for _ in range(72)]
    config = EngineConfig(block_size=4, num_gpu_blocks=24, num_cpu_blocks=8, watermark=0.0,
                          enable_prefix_caching=True, host_prefix_cache=True)
    llm = LLM(folder, config, host_prefix_tier=RaisesOnce, verbose=False)
    engine, bm = llm.engine, llm.engine.block_manager
    llm.generate([conversation], SamplingParams(max_tokens=1))
    llm.generate([other], SamplingParams(max_tokens=1))  # the conversation's head stays on the device, its tail
    returning, params = conversation + [1, 2, 3], SamplingParams(max_tokens=2)  # goes to the host tier
    RaisesOnce.armed = True
    engine.add_request("returning", returning, params)
    with pytest.raises(RuntimeError, match="plugged-in tier"):
        engine.step()
    check_invariants(engine)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, [o.token_ids]) for o in engine.step() if o.finished)
    assert done["returning"] == roomy(folder, [returning], [params], 4)[0]
    assert bm.cache.num_evictable == bm.cache.num_cached == bm.device_pool.num_used  # nothing held when idle
    big = [rng.randrange(96) for _ in range(90)]  # 23 of the pool's 24 blocks
    assert samples(llm.generate([big], SamplingParams(max_tokens=1))) == roomy(folder, [big], [SamplingParams(max_tokens=1)], 4)


@pytest.mark.parametrize("partial", [False, True])
def test_samples_swapped_right_after_their_prefill_get_private_blocks(folder, partial):
    """Samples sharing a partly filled last block, swapped out and back, must not both write into one block."""
    prompts = [[29, 81], [61, 4, 89, 93, 61], [93, 6, 58, 90]]
    params = [SamplingParams(max_tokens=m, n=n, temperature=1.0, seed=s) for m, n, s in ((2, 3, 79), (3, 3, 91),
                                                                                       (2, 2, 99))]
    config = EngineConfig(block_size=2, num_gpu_blocks=8, num_cpu_blocks=64, preemption_mode="swap",
                          partial_preemption=partial, watermark=0.0)
    llm = LLM(folder, config, verbose=False)
    assert samples(serve_checked(llm, prompts, params, max_steps=1000)) == roomy(folder, prompts, params, 2)
    assert llm.metrics.num_preemptions_swap > 0


@pytest.mark.parametrize("num_gpu_blocks, partial", [(8, False), (8, True), (9, False)])
def test_a_cached_sample_block_holds_that_samples_kv(folder, num_gpu_blocks, partial):
    """A block named in the prefix cache after a sample's text must hold that sample's K/V, or a later greedy
    request whose prompt is that text reads another sample's K/V from the cache."""
    prompts = [[29, 81], [61, 4, 89, 93, 61], [93, 6, 58, 90]]
    params = [SamplingParams(max_tokens=m, n=n, temperature=1.0, seed=s) for m, n, s in ((2, 3, 79), (3, 3, 91),
                                                                                       (2, 2, 99))]
    config = EngineConfig(block_size=2, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=64, preemption_mode="swap",
                          partial_preemption=partial, enable_prefix_caching=True, watermark=0.0)
    llm = LLM(folder, config, verbose=False)
    outs = serve_checked(llm, prompts, params, max_steps=1000)
    assert samples(outs) == roomy(folder, prompts, params, 2)
    follow_ups = [p + s.token_ids for p, out in zip(prompts, outs) for s in out.samples]
    greedy = SamplingParams(max_tokens=2)
    assert samples(serve_checked(llm, follow_ups, greedy, max_steps=1000)) == roomy(folder, follow_ups,
                                                                                    [greedy] * len(follow_ups), 2)
    assert llm.metrics.prefix_cache_hit_tokens > 0


class FailsOnce(LatestArrivalPolicy):
    """A learner's policy with a bug that shows once."""

    def __init__(self):
        super().__init__()
        self.failed = False

    def select_victim(self, candidates, shortfall):
        if not self.failed:
            self.failed = True
            raise RuntimeError("a bug in a plugged-in policy")
        return super().select_victim(candidates, shortfall)


def test_a_step_that_raises_carries_out_what_it_planned(folder):
    """The raise comes after a sample was given its private copy-on-write block: the copy must still be made."""
    prompts = [[7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 3, 3], [11, 12, 13, 14, 15, 16], [1, 2, 3]]
    params = SamplingParams(max_tokens=12, n=3)
    config = EngineConfig(block_size=4, num_gpu_blocks=10, num_cpu_blocks=64, preemption_mode="swap", watermark=0.0)
    llm = LLM(folder, config, preemption_policy=FailsOnce(), verbose=False)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"r{i}", prompt, params)
    done, raised = {}, 0
    while llm.engine.has_unfinished_requests():
        try:
            done.update((o.request_id, [s.token_ids for s in o.samples]) for o in llm.engine.step() if o.finished)
        except RuntimeError as error:
            assert "plugged-in policy" in str(error)
            raised += 1
        check_invariants(llm.engine)
    assert raised == 1
    assert [done[f"r{i}"] for i in range(3)] == roomy(folder, prompts, [params] * 3, 4)


# ---- lost requests and unusable engines ---------------------------------------------------------
class RaisingDetector:
    def __init__(self, on_step):
        self.on_step, self.calls = on_step, 0

    def observe(self, metrics):
        self.calls += 1
        if self.calls == self.on_step:
            raise RuntimeError("detector bug")
        return None


def test_generate_that_raises_leaves_the_llm_usable(folder):
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=64), oversubscription_detector=RaisingDetector(3),
              verbose=False)
    with pytest.raises(RuntimeError, match="detector bug"):
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.device_pool.num_free == 64
    expected = roomy(folder, [[1, 2, 3]], [SamplingParams(max_tokens=6)], 4)
    assert samples(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6))) == expected


def test_generate_keeps_requests_added_through_the_engine(folder):
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=64), verbose=False)
    llm.engine.add_request("req-0", [9, 8, 7], SamplingParams(max_tokens=20))  # the id generate once used itself
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert len(outs) == 1 and len(outs[0].token_ids) == 3
    mine = {}
    while llm.engine.has_unfinished_requests():
        mine.update((o.request_id, o.token_ids) for o in llm.engine.step() if o.finished)
    assert mine == {"req-0": roomy(folder, [[9, 8, 7]], [SamplingParams(max_tokens=20)], 4)[0][0]}


def test_a_request_recomputed_past_pool_minus_watermark_is_readmitted(folder):
    """A grew to more blocks than admission allows beside the watermark, then was preempted by recompute."""
    config = EngineConfig(block_size=4, num_gpu_blocks=10, watermark=0.2, preemption_mode="recompute")
    llm = LLM(folder, config, verbose=False)
    engine, done = llm.engine, {}
    engine.add_request("A", [5, 6, 7, 8], SamplingParams(max_tokens=36), arrival_time=10.0)
    for _ in range(22):
        engine.step()
    engine.add_request("B", [9], SamplingParams(max_tokens=20), arrival_time=5.0)  # older than A: A is the victim
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        check_invariants(engine)
    assert llm.metrics.num_preemptions_recompute > 0
    expected = roomy(folder, [[5, 6, 7, 8], [9]], [SamplingParams(max_tokens=36), SamplingParams(max_tokens=20)], 4)
    assert [done["A"], done["B"]] == [e[0] for e in expected]


def test_more_samples_than_max_num_seqs_is_rejected_with_the_fix(folder):
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=64, max_num_seqs=2), verbose=False)
    bad, good = llm.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=4, n=3), SamplingParams(max_tokens=4, n=2)])
    assert bad.rejected and "max_num_seqs=2" in bad.error and "lower n" in bad.error
    assert not good.rejected and len(good.samples) == 2


def test_resumed_samples_stay_within_the_token_budget(folder):
    """Swapped samples resume within max_num_batched_tokens; a resume never leaves a negative budget."""
    prompts = [[70, 57, 13, 60], [15, 0, 25, 43, 71, 15], [44, 5, 57, 50]]
    params = [SamplingParams(max_tokens=m, n=3, temperature=1.0, seed=s) for m, s in ((9, 17), (3, 81), (3, 8))]
    config = EngineConfig(block_size=4, num_gpu_blocks=5, num_cpu_blocks=64, preemption_mode="swap",
                          max_num_batched_tokens=2, watermark=0.0)
    llm = LLM(folder, config, verbose=False)
    assert samples(serve_checked(llm, prompts, params, max_steps=2000)) == roomy(folder, prompts, params, 4)
    assert llm.metrics.num_swapped_in_blocks > 0
    assert max(r.num_batched_tokens for r in llm.metrics.timeline) <= 2


def test_what_goes_out_comes_back(folder):
    """Three samples that cannot all fit swap out at different times and come back one by one."""
    params = SamplingParams(max_tokens=12, n=3)
    config = EngineConfig(block_size=4, num_gpu_blocks=6, num_cpu_blocks=64, preemption_mode="swap", watermark=0.0)
    llm = LLM(folder, config, verbose=False)
    assert samples(serve_checked(llm, [[1, 2, 3, 4]], params, max_steps=1000)) == roomy(folder, [[1, 2, 3, 4]],
                                                                                       [params], 4)
    m = llm.metrics
    assert m.num_preemptions_swap > 0 and m.num_preemptions_recompute == 0 and m.num_recomputed_tokens == 0
    assert m.num_swapped_in_blocks > 0


# ---- abort ---------------------------------------------------------------------------------------
ABORT_SCENES = {  # state: (x's prompt length, x's params, another request's (prompt length, max_tokens, arrival))
    "waiting": (6, SamplingParams(max_tokens=8), (8, 6, -1.0)),
    "mid-prefill": (20, SamplingParams(max_tokens=8), (3, 6, 1.0)),
    "running": (6, SamplingParams(max_tokens=20), (3, 6, 1.0)),
    "forked": (6, SamplingParams(max_tokens=20, n=3), (3, 6, 1.0)),
    "swapped": (4, SamplingParams(max_tokens=40), (4, 40, -1.0)),  # the older one grows, x is swapped out
}


def _reached(engine, state: str) -> bool:
    seqs = engine._requests["x"]
    statuses = {s.status for s in seqs}
    if state == "waiting":
        return statuses == {SequenceStatus.WAITING}
    if state == "mid-prefill":
        return statuses == {SequenceStatus.RUNNING} and seqs[0].num_computed_tokens < len(seqs[0].prompt_token_ids)
    if state == "forked":
        return len(seqs) == 3
    return {"running": SequenceStatus.RUNNING, "swapped": SequenceStatus.SWAPPED}[state] in statuses


@pytest.mark.parametrize("state", ABORT_SCENES)
def test_abort_frees_everything_in_every_state(folder, state):
    config = EngineConfig(block_size=4, num_gpu_blocks=12, num_cpu_blocks=32, preemption_mode="swap",
                          max_num_batched_tokens=8, enable_prefix_caching=True, watermark=0.0)
    llm = LLM(folder, config, verbose=False)
    engine = llm.engine
    length, params, (other_length, other_tokens, other_arrival) = ABORT_SCENES[state]
    other = list(range(20, 20 + other_length))
    engine.add_request("other", other, SamplingParams(max_tokens=other_tokens), arrival_time=other_arrival)
    engine.add_request("x", list(range(40, 40 + length)), params, arrival_time=0.0)
    for _ in range(100):
        if _reached(engine, state):
            break
        assert all(out.request_id != "x" or not out.finished for out in engine.step())
    assert _reached(engine, state), f"x never reached the state {state!r}"
    engine.abort_request("x")
    check_invariants(engine)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "x"
            finished[out.request_id] = out.token_ids
        check_invariants(engine)
    bm = engine.block_manager
    assert bm.device_pool.num_used == bm.cache.num_cached and bm.host_pool.num_used == 0  # only the cache's own blocks remain
    assert llm.metrics.num_aborted == 1 and "x" not in llm.metrics.requests
    assert finished["other"] == roomy(folder, [other], [SamplingParams(max_tokens=other_tokens)], 4)[0][0]


def test_abort_of_an_unknown_or_rejected_request(folder):
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=8), verbose=False)
    llm.engine.abort_request("nobody")
    llm.engine.add_request("too-long", [1] * 100, SamplingParams(max_tokens=2))
    llm.engine.abort_request("too-long")
    assert llm.engine.step() == [] and not llm.engine.has_unfinished_requests()


# ---- limits and counts ---------------------------------------------------------------------------
def test_forks_stay_within_max_num_seqs(folder):
    config = EngineConfig(block_size=4, num_gpu_blocks=64, max_num_seqs=4)
    llm = LLM(folder, config, verbose=False)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    params = [SamplingParams(max_tokens=6, n=3), SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, n=2)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        llm.engine.add_request(f"r{i}", p, sp)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        assert len(llm.engine.scheduler.running) <= 4
    assert max(r.num_running for r in llm.metrics.timeline) == 4


class CountsVictims(LatestArrivalPolicy):
    def __init__(self):
        super().__init__()
        self.victims = 0

    def select_victim(self, candidates, shortfall):
        self.victims += 1
        return super().select_victim(candidates, shortfall)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_every_victim_counts_as_a_preemption(folder, mode):
    """With partial preemption a paused holder gives blocks again and again: each time is a preemption."""
    config = EngineConfig(block_size=1, num_gpu_blocks=50, num_cpu_blocks=50, preemption_mode=mode,
                          partial_preemption=True, watermark=0.0, max_num_batched_tokens=21)
    policy = CountsVictims()
    llm = LLM(folder, config, preemption_policy=policy, verbose=False)
    engine, params = llm.engine, SamplingParams(max_tokens=8)
    engine.add_request("A", list(range(1, 30)), params, arrival_time=1.0)
    engine.step()
    engine.step()
    engine.add_request("C", list(range(30, 70)), params, arrival_time=0.0)  # older than A: A gives up blocks
    while engine.has_unfinished_requests():
        engine.step()
    m = llm.metrics
    assert policy.victims > 1
    assert m.num_preemptions == policy.victims == m.requests["A"].num_preemptions
    assert m.num_preemptions_swap + m.num_preemptions_recompute == m.num_preemptions >= m.num_swap_fallbacks


def test_swap_with_room_on_the_host_never_recomputes(folder):
    """Swapped sequences holding only host blocks are never dropped to make room: they free no device block."""
    for seed in range(6):
        block_size, prompts, params = fuzzed_workload(seed, n_choices=(1, 2))
        need = max(-(-(len(p) + sp.max_tokens) // block_size) for p, sp in zip(prompts, params))
        config = EngineConfig(block_size=block_size, num_gpu_blocks=need + 2, num_cpu_blocks=512,
                              preemption_mode="swap", partial_preemption=seed % 2 == 0, watermark=0.0)
        llm = LLM(folder, config, verbose=False)
        assert samples(serve_checked(llm, prompts, params, max_steps=5000)) == roomy(folder, prompts, params,
                                                                                     block_size)
        assert llm.metrics.num_recomputed_tokens == 0 and llm.metrics.num_preemptions_recompute == 0


def test_a_finished_request_id_cannot_be_reused_while_its_record_is_kept(folder):
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=16), verbose=False)
    serve_checked(llm, [[1, 2]], SamplingParams(max_tokens=2), max_steps=10)
    [request_id] = llm.metrics.requests
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request(request_id, [3, 4], SamplingParams(max_tokens=2))


def test_sample_streams_are_derived_not_offset(folder):
    """Requests seeded 0, 1, 2 with n = 2 draw from six different streams, and sample j of a request seeded s
    draws like an n = 1 request seeded ``sample_stream_seed(s, j)``."""
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=128), verbose=False)
    outs = llm.generate([[1, 2, 3]] * 3, [SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=s) for s in range(3)])
    streams = [tuple(s.token_ids) for out in outs for s in out.samples]
    assert len(set(streams)) == 6
    single = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=1.0, seed=sample_stream_seed(2, 1)))
    assert single[0].token_ids == list(streams[5])


def test_swap_without_a_host_pool_says_so_once(folder, caplog):
    with caplog.at_level(logging.WARNING, logger="kvlib"):
        LLM(folder, EngineConfig(preemption_mode="swap", num_gpu_blocks=8), verbose=False)
    [message] = [r.getMessage() for r in caplog.records]
    assert "num_cpu_blocks=0" in message and "recompute" in message


# ---- bad input -----------------------------------------------------------------------------------
def test_integer_token_ids_of_any_kind_are_accepted(folder):
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=32), verbose=False)
    plain = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids
    for prompt in ([np.int64(5), np.int32(6), 7], list(torch.tensor([5, 6, 7]))):
        assert llm.generate([prompt], SamplingParams(max_tokens=3))[0].token_ids == plain


@pytest.mark.parametrize("bad, named", [(5.0, "float"), ("7", "str"), (None, "NoneType"), (True, "bool")])
def test_token_ids_that_are_not_integers_name_their_type(folder, bad, named):
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=32), verbose=False)
    out = llm.generate([[5, bad, 7]], SamplingParams(max_tokens=3))[0]
    assert out.rejected and "must be integers" in out.error and named in out.error


@pytest.mark.parametrize("prompts, message", [(None, "prompts must be"), (5, "prompts must be"),
                                              (np.array([1, 2, 3]), ".tolist()")])
def test_generate_rejects_what_is_not_a_prompt(folder, prompts, message):
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=32), verbose=False)
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts)
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        llm.generate([[1, 2]], params={})
    assert not llm.engine.has_unfinished_requests()


def test_request_ids_are_strings(folder):
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=32), verbose=False)
    with pytest.raises(TypeError, match="request_id must be a string"):
        llm.engine.add_request(7, [1, 2])


def test_max_model_len_beyond_the_models_positions(folder):
    with pytest.raises(ValueError, match="beyond the model's 1024 positions"):
        LLM(folder, EngineConfig(max_model_len=5000, num_gpu_blocks=8), verbose=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=True), "block_size must be a positive integer"),
    (dict(partial_preemption="yes"), "partial_preemption must be True or False"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching must be True or False"),
    (dict(seed="x"), "seed must be an integer"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(metrics_history=0), "metrics_history must be a positive integer or None"),
])
def test_engine_config_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=math.inf), "temperature must be a finite number"),
    (dict(max_tokens=True), "max_tokens must be a positive integer"),
    (dict(n=True), "n must be a positive integer"),
    (dict(stop_token_ids=5), r"stop_token_ids=\[id\]"),
    (dict(stop_token_ids=None), "stop_token_ids must be a list"),
    (dict(seed=2**70), "seed must be None or an integer from 0 to 2\\*\\*64 - 1"),
    (dict(seed=-1), "seed must be None or an integer"),
])
def test_sampling_params_name_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


class ReturnsNone(LatestArrivalPolicy):
    def select_victim(self, candidates, shortfall):
        return None


def test_a_policy_that_returns_none_is_told_what_to_return(folder):
    config = EngineConfig(block_size=4, num_gpu_blocks=6, watermark=0.0)
    llm = LLM(folder, config, preemption_policy=ReturnsNone(), verbose=False)
    with pytest.raises(TypeError, match="must return one of the VictimCandidate"):
        llm.generate([[1, 2, 3, 4]] * 3, SamplingParams(max_tokens=8))
    check_invariants(llm.engine)
    assert not llm.engine.has_unfinished_requests()


def test_a_policy_that_chooses_a_mode_needs_auto(folder):
    class Chooser(LatestArrivalPolicy):
        def choose_mode(self, victim, context):
            return "swap"
    with pytest.raises(ValueError, match="preemption_mode='auto'"):
        LLM(folder, EngineConfig(num_gpu_blocks=8, preemption_mode="recompute"), preemption_policy=Chooser(),
            verbose=False)
    with pytest.raises(TypeError, match="takes a cost model, not a mode"):
        LatestArrivalPolicy("swap")


def without(piece, member: str):
    """``piece`` with one member of its protocol missing, as a learner's half-written class would be."""
    class Without:
        def __getattr__(self, name):
            if name == member:
                raise AttributeError(name)
            return getattr(piece, name)
    return Without()


@pytest.mark.parametrize("argument, plugged, protocol, member", [
    ("allocator", lambda: (lambda n: without(BlockAllocator(n), "ref_count")), "BlockAllocator", "ref_count"),
    ("attention_backend", lambda: without(TorchAttentionBackend(), "copy_blocks"), "AttentionBackend", "copy_blocks"),
    ("block_sharing", lambda: without(BlockSharing(), "make_writable"), "BlockSharing", "make_writable"),
    ("oversubscription_detector", lambda: object(), "OversubscriptionDetector", "observe"),
    ("host_prefix_tier", lambda: (lambda cpu: without(HostPrefixTier(cpu), "touch")), "HostPrefixTier", "touch"),
])
def test_a_plugged_piece_missing_part_of_its_protocol_is_refused_when_the_engine_is_built(
        folder, argument, plugged, protocol, member):
    config = EngineConfig(num_gpu_blocks=16, num_cpu_blocks=8, enable_prefix_caching=True, host_prefix_cache=True)
    with pytest.raises(TypeError, match=f"{argument}=.* does not implement kvlib.interfaces.{protocol}: it has no {member};"):
        LLM(folder, config, verbose=False, **{argument: plugged()})


def test_the_protocol_check_runs_no_property_of_a_half_written_piece():
    """A lab's untouched stub raises NotImplementedError from its properties; the check only looks."""
    class StubAllocator:
        num_blocks = 4

        @property
        def num_free(self):
            raise NotImplementedError("Task 1: count the free blocks")

        num_used = num_free
        ref_count = can_allocate = allocate = fork = free = lambda self, *args: None

    check_implements(StubAllocator(), interfaces.BlockAllocator, "allocator")
    del StubAllocator.free
    with pytest.raises(TypeError, match="it has no free;"):
        check_implements(StubAllocator(), interfaces.BlockAllocator, "allocator")


def test_triton_works_whatever_was_imported_first():
    """transformers imports Triton before kvlib can switch on its interpreter."""
    code = ("import transformers, triton\n"
            "from kvlib import LLM, EngineConfig, SamplingParams\n"
            "kw = dict(block_size=4, num_gpu_blocks=16, device='cpu')\n"
            "t = LLM('default', EngineConfig(attention_backend='triton', **kw), verbose=False)\n"
            "r = LLM('default', EngineConfig(attention_backend='torch', **kw), verbose=False)\n"
            "p = SamplingParams(max_tokens=3)\n"
            "assert t.generate([[3, 4, 5]], p)[0].token_ids == r.generate([[3, 4, 5]], p)[0].token_ids\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    if torch.cuda.is_available():
        pytest.skip("with a GPU, Triton compiles kernels and needs no interpreter")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


# ---- long runs -----------------------------------------------------------------------------------
def test_memory_stays_bounded_over_a_long_run(folder):
    history = 20
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=64, metrics_history=history), verbose=False)
    rng = random.Random(0)
    for _ in range(6):
        prompts = [[rng.randrange(96) for _ in range(rng.randint(1, 8))] for _ in range(10)]
        llm.generate(prompts, SamplingParams(max_tokens=4))
    m = llm.metrics
    assert m.num_finished == 60 and len(m.requests) == history and len(m.timeline) == history
    assert not llm.engine._requests
    summary = m.summary()
    assert summary["num_finished"] == 60 and summary["ttft_p50"] is not None
    assert "requests" not in summary and "steps" not in summary  # counters and percentiles, no history


def test_admission_does_not_count_room_for_the_last_tokens_kv_which_is_never_stored(checkpoint):
    """A prompt of 3 tokens and 2 new ones stores K/V for 4 positions: one block of 4, not two."""
    path = checkpoint("llama-gqa")
    tight = LLM(path, EngineConfig(block_size=4, num_gpu_blocks=1, watermark=0.0), verbose=False)
    roomy = LLM(path, EngineConfig(block_size=4, num_gpu_blocks=16, watermark=0.0), verbose=False)
    prompts, params = [[3, 4, 5], [3, 4, 5, 6], [3, 4, 5, 6]], [SamplingParams(max_tokens=2, ignore_eos=True),
                                                                SamplingParams(max_tokens=1, ignore_eos=True),
                                                                SamplingParams(max_tokens=2, ignore_eos=True)]
    outs = tight.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length", "length", "rejected"]
    assert "needs 2 KV blocks" in outs[2].error
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in roomy.generate(prompts[:2], params[:2])]


class AbortsItsFirstVictim(LatestArrivalPolicy):
    """Aborts the request of the first victim it chooses, from inside the victim choice."""

    def __init__(self):
        super().__init__()
        self.engine, self.aborted = None, []

    def select_victim(self, candidates, shortfall):
        victim = super().select_victim(candidates, shortfall)
        if not self.aborted:
            self.aborted.append(victim.seq.request_id)
            self.engine.abort_request(victim.seq.request_id)
        return victim


VICTIM_PROMPTS = [[3 + i, 4, 5, 6, 7] for i in range(4)]  # four requests in 10 blocks: one is preempted
VICTIM_PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def llm_aborting_its_first_victim(path):
    policy = AbortsItsFirstVictim()
    config = EngineConfig(block_size=4, num_gpu_blocks=10, num_cpu_blocks=16, preemption_mode="swap", watermark=0.0)
    llm = LLM(path, config, preemption_policy=policy, verbose=False)
    policy.engine = llm.engine
    return llm, policy


def test_a_policy_that_aborts_its_victims_request_while_choosing_it_leaves_the_step_whole(checkpoint):
    """Aborting during a step (here from the victim choice) takes effect when the step ends: nothing raises,
    that step returns the request's last output, ended "aborted", and no later one returns anything for it;
    every block comes back, the others keep their tokens."""
    path = checkpoint("llama-gqa")

    llm, policy = llm_aborting_its_first_victim(path)
    prompts, params = VICTIM_PROMPTS, VICTIM_PARAMS
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"r{i}", prompt, params)
    outputs = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            assert out.request_id not in outputs or not outputs[out.request_id].finished  # nothing after its end
            outputs[out.request_id] = out
        check_invariants(llm.engine)
    assert len(policy.aborted) == 1 and llm.metrics.num_aborted == 1
    ended = outputs.pop(policy.aborted[0])
    assert ended.finished and ended.finish_reason == "aborted"
    bm = llm.engine.block_manager
    assert bm.device_pool.num_free == 10 and bm.host_pool.num_free == 16
    roomy = LLM(path, EngineConfig(block_size=4, num_gpu_blocks=64), verbose=False).generate(prompts, params)
    assert {rid: out.token_ids for rid, out in outputs.items()} == {
        f"r{i}": out.token_ids for i, out in enumerate(roomy) if f"r{i}" not in policy.aborted}
    aborted = int(policy.aborted[0][1:])
    assert ended.token_ids == roomy[aborted].token_ids[:len(ended.token_ids)]


def test_generate_returns_when_a_plugged_in_piece_aborts_one_of_its_requests(checkpoint):
    """A piece that aborts a request of generate's own mid-run: generate returns (it looped forever), that
    request ends "aborted" with the tokens it had, every other one keeps its tokens."""
    path = checkpoint("llama-gqa")

    llm, policy = llm_aborting_its_first_victim(path)
    prompts, params = VICTIM_PROMPTS, VICTIM_PARAMS
    returned = {}
    caller = threading.Thread(target=lambda: returned.update(outputs=llm.generate(prompts, params)), daemon=True)
    caller.start()
    caller.join(timeout=120)
    assert "outputs" in returned, "generate did not return within 120 s"
    outputs = returned["outputs"]
    reference = LLM(path, EngineConfig(block_size=4, num_gpu_blocks=64), verbose=False).generate(prompts, params)
    (aborted,) = [i for i, out in enumerate(outputs) if out.request_id in policy.aborted]
    assert outputs[aborted].finished and outputs[aborted].finish_reason == "aborted"
    assert outputs[aborted].token_ids == reference[aborted].token_ids[:len(outputs[aborted].token_ids)]
    assert [o.token_ids for i, o in enumerate(outputs) if i != aborted] == [
        o.token_ids for i, o in enumerate(reference) if i != aborted]
    assert llm.metrics.num_aborted == 1 and not llm.engine.has_unfinished_requests()
    assert llm.generate(prompts[:1], params)[0].token_ids == reference[0].token_ids  # still usable


class AbortingDetector:
    """Aborts ``request_id`` from inside the step in which ``when(engine)`` first holds."""

    def __init__(self, request_id, when):
        self.engine, self.request_id, self.when, self.done = None, request_id, when, False

    def observe(self, metrics):
        if not self.done and self.when(self.engine):
            self.done = True
            self.engine.abort_request(self.request_id)
        return None


def llm_aborting(folder, config, request_id, when, **pieces):
    detector = AbortingDetector(request_id, when)
    llm = LLM(folder, config, oversubscription_detector=detector, verbose=False, **pieces)
    detector.engine = llm.engine
    return llm


def test_a_request_aborted_before_its_samples_fork_ends_with_all_n_of_them(folder):
    """n = 3, aborted mid-prefill: its output has three samples, not the one sequence it had (a server waited
    for ever on the other choices)."""
    config = EngineConfig(block_size=4, num_gpu_blocks=32, max_num_batched_tokens=4)
    llm = llm_aborting(folder, config, "x", lambda engine: engine.metrics.num_steps == 1)
    llm.engine.add_request("x", list(range(3, 15)), SamplingParams(max_tokens=4, n=3, seed=1))
    (out,) = llm.engine.step()
    assert out.finished and [(s.token_ids, s.finish_reason) for s in out.samples] == [([], "aborted")] * 3
    check_invariants(llm.engine)


def test_a_sample_that_ended_before_its_request_was_aborted_keeps_its_reason(folder):
    params = dict(max_tokens=10, n=2, seed=3, temperature=1.0)
    first, second = roomy(folder, [[5, 6, 7]], [SamplingParams(**params)], 4)[0]
    stop = next(t for t in second[1:6] if t not in first and t not in second[:second.index(t)])
    ends_at = second.index(stop) + 1  # the second sample stops here; the first goes on
    llm = llm_aborting(folder, EngineConfig(block_size=4, num_gpu_blocks=32), "x",
                       lambda engine: len(engine._requests["x"][1].output_token_ids) == ends_at)
    llm.engine.add_request("x", [5, 6, 7], SamplingParams(stop_token_ids=[stop], **params))
    last = None
    while llm.engine.has_unfinished_requests():
        (last,) = llm.engine.step()
    assert [s.finish_reason for s in last.samples] == ["aborted", "stop"]
    assert last.samples[1].token_ids == second[:ends_at]
    assert last.samples[0].token_ids == first[:len(last.samples[0].token_ids)]


def test_a_piece_that_raises_while_an_abort_lets_go_of_blocks_stops_the_engine_saying_so(folder):
    """A plugged-in block manager raises while the step's deferred abort lets x's second sample go: the first has
    let go, the second may have half done, so the books cannot be trusted. The engine stops, naming the request
    and the recovery (it went on with the request half finished, and a later step failed on it)."""
    from kvlib.core.block_manager import BlockManager
    from kvlib.engine import EngineStoppedError

    class FailsOnTheSecondSample(BlockManager):
        def drop(self, seq, count=None):
            if seq.request_id == "x" and seq.sample_index == 1 and count is None:
                raise RuntimeError("drop failed")
            return super().drop(seq, count)

    llm = llm_aborting(folder, EngineConfig(block_size=4, num_gpu_blocks=32), "x",
                       lambda engine: len(engine._requests["x"]) == 2, block_manager=FailsOnTheSecondSample)
    llm.engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=8, n=2, seed=1))
    with pytest.raises(RuntimeError, match="drop failed"):
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    with pytest.raises(EngineStoppedError, match="aborting request 'x' raised RuntimeError: drop failed while letting "
                                                 "go of its blocks.*build a new LLM"):
        llm.engine.step()


def test_aborts_asked_while_the_steps_aborts_are_done_are_done_too(folder):
    """A plugged-in allocator that aborts g0 and g1 at the first block freed after a detector aborted g0, so while
    the step's deferred abort of g0 frees its blocks: g1 ends with an output too (it was aborted at once and
    silently, and generate waited for ever), and g0, aborted again, once."""
    from kvlib.core.block_allocator import BlockAllocator

    made = []

    class AbortingAllocator(BlockAllocator):
        def free(self, block_id):
            super().free(block_id)
            if llm.engine.oversubscription.done and not made[0]:
                made[0] = True
                for request_id in ("g0", "g1"):
                    llm.engine.abort_request(request_id)

    made.append(False)
    llm = llm_aborting(folder, EngineConfig(block_size=4, num_gpu_blocks=32), "g0",
                       lambda engine: len(engine._requests["g0"][0].output_token_ids) == 2, allocator=AbortingAllocator)
    for request_id in ("g0", "g1"):
        llm.engine.add_request(request_id, [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    ended = {}
    for _ in range(20):
        for out in llm.engine.step():
            assert out.request_id not in ended
            if out.finished:
                ended[out.request_id] = out.finish_reason
        if not llm.engine.has_unfinished_requests():
            break
    assert ended == {"g0": "aborted", "g1": "aborted"} and llm.metrics.num_aborted == 2
    check_invariants(llm.engine)


def test_an_abort_a_piece_asks_for_while_a_caller_aborts_ends_with_an_output_from_the_next_step(folder):
    """The caller aborts g0 between steps; a plugged-in allocator aborts g1 as g0's blocks are freed: g1's owner
    gets its ending from the next step (it was aborted silently)."""
    from kvlib.core.block_allocator import BlockAllocator

    class AbortingAllocator(BlockAllocator):
        armed = False

        def free(self, block_id):
            super().free(block_id)
            if AbortingAllocator.armed:
                AbortingAllocator.armed = False
                llm.engine.abort_request("g1")

    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=32), allocator=AbortingAllocator, verbose=False)
    for request_id in ("g0", "g1"):
        llm.engine.add_request(request_id, [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    llm.engine.step()
    AbortingAllocator.armed = True
    llm.engine.abort_request("g0")
    (out,) = llm.engine.step()
    assert (out.request_id, out.finished, out.finish_reason, len(out.token_ids)) == ("g1", True, "aborted", 1)
    assert llm.metrics.num_aborted == 2 and not llm.engine.has_unfinished_requests()
    check_invariants(llm.engine)


def test_an_abort_asked_in_the_step_a_request_finishes_in_is_too_late_and_loses_nothing(folder):
    """Aborting from inside the step that finishes the request: it has finished, so its output comes back with
    its own finish reason (the step dropped it, and its id stayed taken with no output ever handed out)."""
    llm = llm_aborting(folder, EngineConfig(block_size=4, num_gpu_blocks=16), "x", lambda engine: True)
    llm.engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    (out,) = llm.engine.step()  # x finishes in the first step, the one the abort is asked in
    assert out.request_id == "x" and out.finished and out.finish_reason == "length" and len(out.token_ids) == 1
    assert llm.metrics.num_aborted == 0 and not llm.engine.has_unfinished_requests()
    check_invariants(llm.engine)


class AbortsWhileAdding:
    """A scheduler whose ``add`` asks the engine to abort the request ids in ``aborts`` (a plugged-in piece may)."""

    def __init__(self, scheduler_class, aborts):
        self.aborts = aborts
        piece = self

        class Aborting(scheduler_class):
            def add(self, seq):
                super().add(seq)
                for request_id in piece.aborts.pop(seq.request_id, ()):
                    piece.engine.abort_request(request_id)
        self.scheduler = Aborting


def llm_aborting_while_adding(folder, aborts):
    from kvlib.core.scheduler import Scheduler
    piece = AbortsWhileAdding(Scheduler, aborts)
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=32), scheduler=piece.scheduler, verbose=False)
    piece.engine = llm.engine
    return llm


def test_a_piece_that_aborts_the_request_being_added_ends_it_with_an_output_from_the_next_step(folder):
    """The abort was asked while the request was not yet the engine's own: it was lost, and the request ran to
    its end. Now it is done once the request is in, and the next step hands back its ending."""
    llm = llm_aborting_while_adding(folder, {"x": ["x"]})
    llm.engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=8, n=2, seed=1))
    (out,) = llm.engine.step()
    assert out.request_id == "x" and out.finished
    assert [(s.token_ids, s.finish_reason) for s in out.samples] == [([], "aborted")] * 2
    assert llm.metrics.num_aborted == 1 and not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.device_pool.num_free == 32
    check_invariants(llm.engine)


def test_a_piece_that_aborts_another_request_while_one_is_added_ends_both_properly(folder):
    """Adding y aborts x, which is running: x ends "aborted" with the tokens it had, y runs as if alone."""
    llm = llm_aborting_while_adding(folder, {"y": ["x"]})
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm.engine.add_request("x", [5, 6, 7], params)
    (first,) = llm.engine.step()
    llm.engine.add_request("y", [8, 9], params)
    outputs = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            assert out.request_id not in outputs or not outputs[out.request_id].finished
            outputs[out.request_id] = out
        check_invariants(llm.engine)
    assert outputs["x"].finished and outputs["x"].finish_reason == "aborted"
    assert outputs["x"].token_ids == first.token_ids
    alone = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=32), verbose=False).generate([[8, 9]], params)
    assert outputs["y"].token_ids == alone[0].token_ids and outputs["y"].finish_reason == "length"
    assert llm.engine.block_manager.device_pool.num_free == 32


def test_samples_that_fork_are_the_requests_own_even_when_the_step_is_interrupted_after_forking(folder, monkeypatch):
    """An interrupt (Ctrl-C in a notebook) after the scheduler forked x's samples but before the engine had
    taken them as x's: x never finished (it waited for n samples it had lost). Now they are x's as they fork."""
    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=32), verbose=False)
    llm.engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=4, n=3, seed=1, temperature=1.0))
    record_result = llm.metrics.record_result

    def interrupted(plan, result, *args):
        record_result(plan, result, *args)
        if result.forked:
            monkeypatch.setattr(llm.metrics, "record_result", record_result)
            raise KeyboardInterrupt
    monkeypatch.setattr(llm.metrics, "record_result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.engine.step()
    last = None
    while llm.engine.has_unfinished_requests():
        (last,) = llm.engine.step()
    assert last is not None and last.finished and len(last.samples) == 3
    assert [len(s.token_ids) for s in last.samples] == [4, 4, 4]
    assert llm.engine.block_manager.device_pool.num_free == 32


def test_a_scheduler_that_plans_nothing_is_named_with_the_blocks_it_could_have_had(folder):
    """The stall error counts cached blocks nobody uses as room (it said 0 free of a pool full of them)."""
    from kvlib.core.scheduler import Scheduler

    class StopsAdmitting(Scheduler):
        stopped = False

        def schedule_waiting(self, out, budget):
            return budget if StopsAdmitting.stopped else super().schedule_waiting(out, budget)

    llm = LLM(folder, EngineConfig(block_size=4, num_gpu_blocks=8, enable_prefix_caching=True), scheduler=StopsAdmitting,
              verbose=False)
    llm.generate([list(range(3, 35))], SamplingParams(max_tokens=1))  # its 8 blocks stay cached, for no one
    assert llm.engine.block_manager.device_pool.num_free == 0
    StopsAdmitting.stopped = True
    llm.engine.add_request("x", [3, 4], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="1 waiting, 0 running, 0 swapped, 8/8 device blocks free or cached for "
                                           "no one; this is a bug in the scheduler"):
        llm.engine.step()
