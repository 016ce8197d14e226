"""The scheduler with no model, over many workloads: exact token accounting, limits and refusals.

Pins down that every request ends with exactly the tokens it asked for, that the positions
computed add up to each prompt and output once plus exactly the tokens preemption made
recomputed (in pools tight enough to preempt and to fall back from swap), that no step exceeds the token budget or ``max_num_seqs``, that the counters of
preemption agree with each other, that a stop token ends a request early, that a step with a
sequence mid-prefill draws no token for it, and each reason ``why_never`` gives, at its edge.
"""
import random

import pytest

from kvlib.core.model_free import ModelFreeEngine
from kvlib.core.model_free import Request
from kvlib.config import EngineConfig, SamplingParams
from kvlib.core.invariants import check_invariants
from kvlib.core.scheduler import Scheduler
from kvlib.core.sequence import Sequence, SequenceStatus

BS = 4


def engine(**config) -> ModelFreeEngine:
    return ModelFreeEngine(EngineConfig(**{"block_size": BS, "watermark": 0.0, **config}))


def workload(seed: int, count: int = 7) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(50) for _ in range(rng.randint(1, 14))], rng.randint(1, 12), arrival=i)
            for i in range(count)]


def run_to_end(e: ModelFreeEngine, config: EngineConfig) -> int:
    """Step until every request is done, checking the bookkeeping and the limits; return the tokens computed."""
    computed, steps = 0, 0
    while e.has_unfinished():
        e.step()
        check_invariants(e)
        batch = sum(n for _, n in e.last_plan.scheduled)
        assert 0 < batch <= config.max_num_batched_tokens
        assert len(e.scheduler.running) <= config.max_num_seqs
        computed += batch
        steps += 1
        assert steps < 2000, "the workload never finished"
    return computed


CONFIGS = [dict(preemption_mode=mode, partial_preemption=partial, max_num_batched_tokens=budget,
                num_gpu_blocks=gpu, num_cpu_blocks=cpu, max_num_seqs=seqs)
           for mode in ("swap", "recompute") for partial in (False, True)
           for budget, gpu, cpu, seqs in ((64, 8, 32, 8), (6, 6, 2, 3))]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_every_position_is_computed_once_plus_what_preemption_lost(config):
    preemptions, swapped, fallbacks = 0, 0, 0
    for seed in range(6):
        e = engine(**config)
        requests = workload(seed)
        for i, request in enumerate(requests):
            e.add(f"r{i}", request)
        computed = run_to_end(e, e.config)
        m = e.metrics
        for i, request in enumerate(requests):
            seq = e.requests[f"r{i}"][0]
            assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
            assert len(seq.output_token_ids) == request.max_tokens
        expected = sum(len(r.prompt) + r.max_tokens - 1 for r in requests)  # the last token is never computed
        assert computed == expected + m.num_recomputed_tokens
        assert m.num_preemptions == m.num_preemptions_swap + m.num_preemptions_recompute
        assert m.num_swapped_in_blocks <= m.num_swapped_out_blocks  # a recompute drops the host copies too
        if m.num_preemptions_recompute == 0:
            assert m.num_swapped_in_blocks == m.num_swapped_out_blocks
        assert sum(s.num_preemptions for seqs in e.requests.values() for s in seqs) == m.num_preemptions
        assert e.block_manager.device_pool.num_free == config["num_gpu_blocks"] and e.block_manager.host_pool.num_used == 0
        if config["preemption_mode"] == "recompute":
            assert m.num_preemptions_swap == 0 and m.num_swapped_out_blocks == 0
        else:
            assert m.num_preemptions_swap == m.num_preemptions - m.num_swap_fallbacks
        preemptions, swapped, fallbacks = (preemptions + m.num_preemptions, swapped + m.num_swapped_out_blocks,
                                           fallbacks + m.num_swap_fallbacks)
    if config["num_gpu_blocks"] == 6:  # the tight pools: the checks above saw preemption of every kind
        assert preemptions > 0
        if config["preemption_mode"] == "swap":
            assert swapped > 0 and fallbacks > 0


def test_a_stop_token_ends_a_request_before_max_tokens():
    e = engine(num_gpu_blocks=8)
    seq = Sequence("s", [5, 6, 7], SamplingParams(max_tokens=9, stop_token_ids=[0]), BS, 0.0)
    e.scheduler.add(seq)  # the model-free engine samples token 0 every time
    result = e.step()
    assert result.finished == [seq] and seq.finish_reason == "stop" and seq.output_token_ids == [0]
    assert not e.has_unfinished() and e.block_manager.device_pool.num_free == 8


def test_a_sequence_mid_prefill_draws_no_token():
    e = engine(num_gpu_blocks=16, max_num_batched_tokens=10)
    a = e.add("a", Request(list(range(8)), 2, arrival=0))
    b = e.add("b", Request(list(range(8)), 2, arrival=1))
    first = e.step()
    assert first.sampled == [a] and b.num_computed_tokens == 2 and b.output_token_ids == []
    second = e.step()
    assert second.sampled == [a, b] and second.finished == [a]
    assert [len(s.output_token_ids) for s in (a, b)] == [2, 1]


def test_samples_each_draw_their_own_token_after_a_shared_prompt():
    e = engine(num_gpu_blocks=16, max_num_seqs=4)
    e.add("p", Request(list(range(6)), 2, n=3, arrival=0))
    first = e.step()
    samples = e.requests["p"]
    assert len(first.forked) == 2 and first.sampled == samples and len(samples) == 3
    assert [s.sample_index for s in samples] == [0, 1, 2] and len(e.scheduler.running) == 3
    assert all(s.output_token_ids == [0] for s in samples)
    e.step()
    assert all(s.status is SequenceStatus.FINISHED for s in samples)


@pytest.mark.parametrize("prompt, max_tokens, n, reason", [
    (12, 5, 2, None),  # 16 positions hold K/V: the 17th token is sampled, never stored
    (13, 3, 1, "its prompt of 13 tokens needs 4 KV blocks of 4 tokens, more than the 3 the pool can ever "
               "admit; raise num_gpu_blocks or shorten the prompt"),
    (12, 6, 1, "prompt (12 tokens) plus max_tokens (6), less the last token whose K/V is never stored, needs 5 KV "
               "blocks of 4 tokens but the pool has 4; raise num_gpu_blocks or lower max_tokens"),
    (4, 1, 3, "its n=3 samples run as 3 sequences, more than max_num_seqs=2; raise max_num_seqs or lower n"),
])
def test_why_never_names_the_limit_at_its_edge(prompt, max_tokens, n, reason):
    e = engine(num_gpu_blocks=4, watermark=0.25, max_num_seqs=2)  # one block kept free for admission
    seq = Sequence("x", list(range(prompt)), SamplingParams(max_tokens=max_tokens, n=n), BS, 0.0)
    assert e.scheduler.why_never(seq) == reason


def test_a_request_waits_while_the_budget_is_spent():
    e = engine(num_gpu_blocks=16, max_num_batched_tokens=4)
    a = e.add("a", Request(list(range(4)), 3, arrival=0))
    b = e.add("b", Request(list(range(3)), 3, arrival=1))
    e.step()
    assert a.num_computed_tokens == 4 and b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    e.step()
    assert (a.num_computed_tokens, b.num_computed_tokens) == (5, 3)


def states(e: ModelFreeEngine) -> dict:
    """Each request's status, device blocks, host blocks, computed tokens and preemptions."""
    return {rid: (s.status.value, len(s.block_table), len(s.host_blocks), s.num_computed_tokens, s.num_preemptions)
            for rid, (s, *_) in e.requests.items()}


def test_the_newest_running_sequence_is_the_victim_not_the_requester():
    e = engine(num_gpu_blocks=6, max_num_batched_tokens=64)
    for name, arrival in (("a", 0), ("b", 1), ("c", 2)):
        e.add(name, Request(list(range(8)), 4, arrival=arrival))
    e.step()
    e.step()  # a and b each need a third block: c, the newest, gives up both of its own
    assert states(e) == {"a": ("running", 3, 0, 9, 0), "b": ("running", 3, 0, 9, 0),
                         "c": ("waiting", 0, 0, 0, 1)}
    assert e.metrics.num_recomputed_tokens == 8


def test_a_paused_sequence_that_kept_blocks_gives_them_up_before_a_running_one():
    e = engine(num_gpu_blocks=6, preemption_mode="recompute", partial_preemption=True, max_num_batched_tokens=64)
    e.add("big", Request(list(range(16)), 8, arrival=1))
    e.add("small", Request(list(range(3)), 8, arrival=0))
    for _ in range(3):
        e.step()
    assert states(e)["big"] == ("waiting", 4, 0, 16, 1)  # it kept four of its five blocks
    for _ in range(4):
        e.step()  # small needs a third block at position 8: the waiting big gives one more
    assert states(e) == {"big": ("waiting", 3, 0, 12, 2), "small": ("running", 3, 0, 9, 0)}
    assert e.metrics.num_recomputed_tokens == 1 + 4


def test_a_sequence_that_gave_up_its_own_tail_takes_it_back_from_the_prefix_cache():
    e = engine(num_gpu_blocks=3, preemption_mode="recompute", partial_preemption=True, max_num_batched_tokens=64,
               enable_prefix_caching=True)
    e.add("a", Request([34, 43], 2, arrival=0))
    e.add("b", Request(list(range(8)), 2, arrival=1))
    e.step()
    e.step()  # b needs a third block, and a ran first this step: b is its own victim and lets its second block go
    assert states(e)["b"] == ("waiting", 1, 0, 4, 1) and e.metrics.num_recomputed_tokens == 4
    e.step()
    assert e.last_starts == [8]  # the cache still held that block: b computes only its new token
    assert not e.has_unfinished() and len(e.requests["b"][0].output_token_ids) == 2


def test_a_partial_swap_needs_host_room_for_the_tail_only():
    e = engine(num_gpu_blocks=6, num_cpu_blocks=1, preemption_mode="swap", partial_preemption=True,
               max_num_batched_tokens=64)
    e.add("big", Request(list(range(16)), 8, arrival=1))
    e.add("small", Request(list(range(3)), 8, arrival=0))
    for _ in range(3):
        e.step()
    assert states(e)["big"] == ("swapped", 4, 1, 17, 1)  # one block on the host, nothing recomputed
    assert e.metrics.num_swap_fallbacks == 0 and e.metrics.num_swapped_out_blocks == 1


def test_a_victim_taken_from_the_middle_of_the_running_list_leaves_the_rest_scheduled():
    """A policy that gives up the oldest sequence not yet scheduled: c is preempted for b, and d, after c in the
    running list, still gets its token in the same step."""
    from kvlib.core.preemption import LatestArrivalPolicy

    class OldestOther(LatestArrivalPolicy):
        def select_victim(self, candidates, shortfall):
            return next((c for c in candidates if not c.is_requester), candidates[-1])

    e = ModelFreeEngine(EngineConfig(block_size=BS, num_gpu_blocks=9, watermark=0.0, preemption_mode="recompute"),
                        preemption_policy=OldestOther())
    for name, arrival in (("a", 0), ("b", 1), ("c", 2), ("d", 3)):
        e.add(name, Request(list(range(8)), 4, arrival=arrival))
    e.step()  # four prompts of two blocks each: one block left
    e.step()  # a takes the last block; c gives up its two, one for b and one for d
    assert [seq.request_id for seq, *_ in e.last_plan.scheduled] == ["a", "b", "d"]
    assert states(e) == {"a": ("running", 3, 0, 9, 0), "b": ("running", 3, 0, 9, 0), "c": ("waiting", 0, 0, 0, 1),
                         "d": ("running", 3, 0, 9, 0)}


def test_forked_samples_hold_exactly_their_own_places_in_max_num_seqs():
    e = engine(num_gpu_blocks=32, max_num_seqs=4, max_num_batched_tokens=6)
    e.add("p", Request(list(range(6)), 4, n=3, arrival=0))
    e.add("q", Request([1, 2], 4, arrival=1))
    e.add("r", Request([3, 4], 4, arrival=2))
    e.step()  # p's prompt spends the budget; its three samples will fill three of the four places
    assert e.requests["q"][0].status is SequenceStatus.WAITING
    e.step()
    assert [s.status for s in e.requests["p"]] == [SequenceStatus.RUNNING] * 3
    assert e.requests["q"][0].status is SequenceStatus.RUNNING  # the fourth place
    assert e.requests["r"][0].status is SequenceStatus.WAITING and len(e.scheduler.running) == 4


# Partial preemption leaves recomputing sequences waiting with their heads on the device; at step 12 three of them
# hold every block between them and none fits.
HOLDERS_CONFIG = dict(block_size=2, num_gpu_blocks=6, num_cpu_blocks=0, preemption_mode="swap", partial_preemption=True,
                      max_num_batched_tokens=10, max_num_seqs=4)  # no host room: every swap falls back to recompute
HOLDERS_REQUESTS = [Request([2, 2], 5, arrival=0), Request([2, 2, 4, 0, 4, 4, 1], 1, arrival=2),
                    Request([2], 10, arrival=3), Request([4, 0, 1, 3, 2], 6, n=2, arrival=4)]


def holders_scene() -> ModelFreeEngine:
    e = engine(**HOLDERS_CONFIG)
    for i, request in enumerate(HOLDERS_REQUESTS):
        e.add(f"r{i}", request)
    return e


def test_paused_sequences_holding_blocks_give_them_up_when_nothing_else_can_run(monkeypatch):
    """The holders' scene: the scheduler releases them, and all finish."""
    def serve() -> tuple[ModelFreeEngine, int]:
        e = holders_scene()
        for step in range(60):
            if not e.has_unfinished():
                return e, step
            e.step()
            check_invariants(e)
        return e, None

    released = []
    original = Scheduler._release_holders
    monkeypatch.setattr(Scheduler, "_release_holders", lambda self, out, budget: released.append(
        sorted(s.request_id for s in self.waiting + self.swapped if s.block_table.blocks)) or original(self, out, budget))
    e, steps = serve()
    assert steps is not None and released == [["r2", "r3", "r3"]]  # r3 and its second sample
    assert [[len(s.output_token_ids) for s in e.requests[f"r{i}"]] for i in range(4)] == [[5], [1], [10], [6, 6]]
    monkeypatch.setattr(Scheduler, "_release_holders", lambda self, out, budget: None)
    assert serve()[1] is None  # without it, the three wait for each other's blocks for ever


def test_the_first_in_line_keeps_its_blocks_while_those_behind_it_give_theirs_up():
    """The holders' scene at step 12: r2, oldest, cannot grow and gives up its last block; nothing runs. It keeps
    its other three (it gave them up too, and recomputed 9 tokens where 3 were lost); r3's samples give up theirs."""
    e = holders_scene()
    for _ in range(12):
        e.step()
    plan = e.last_plan
    assert [(p.seq.request_id, p.num_blocks) for p in plan.preemptions] == [("r2", 1), ("r3", 2), ("r3", 2)]
    assert [(seq.request_id, n) for seq, n in plan.scheduled] == [("r2", 3)]  # the 2 tokens lost, and its next
    assert len(e.requests["r2"][0].block_table) == 5  # the 3 it kept, and 2 for the tokens it computes now
    while e.has_unfinished():
        e.step()
        check_invariants(e)


def test_a_sequence_that_preempts_itself_while_paused_samples_hold_the_blocks_it_needs_goes_on():
    """r1's paused samples hold only blocks they share, so none is a victim; r3, needing one block, gives up its
    own last one. Were the line asked before anyone paused gave up blocks, r3 would take that block back and give
    it up again every step for ever (2 tokens recomputed each time); the samples give theirs up first."""
    config = dict(block_size=2, num_gpu_blocks=10, preemption_mode="recompute", partial_preemption=True,
                  max_num_seqs=4, max_num_batched_tokens=2, watermark=0.1)
    e = engine(**config)
    e.add("r1", Request([3, 1, 4, 2, 4, 2, 4, 2, 1], 6, n=3, arrival=2))
    e.add("r3", Request([0, 0, 4, 2, 3, 1, 2], 7, arrival=2))
    steps = 0
    while e.has_unfinished() and steps < 200:
        e.step()
        check_invariants(e)
        steps += 1
    assert not e.has_unfinished(), f"after {steps} steps: {states(e)}"
    assert [[len(s.output_token_ids) for s in e.requests[r]] for r in ("r1", "r3")] == [[6, 6, 6], [7]]


def test_cached_blocks_nobody_uses_count_towards_the_watermark():
    """A's 8 prompt blocks stay cached after it ends, and B's growth takes the last free ones: 0 free, 8 that can
    be handed out. C needs 1 block and starts at once; it waited until B finished (the watermark was checked
    against the 0 free blocks alone), and a scheduler that always keeps the watermark waited for ever."""
    e = engine(block_size=2, num_gpu_blocks=10, watermark=0.1, enable_prefix_caching=True, max_num_batched_tokens=64)
    e.add("A", Request(list(range(16)), 1, arrival=0))
    e.step()
    e.add("B", Request([100, 101], 12, arrival=1))
    for _ in range(3):
        e.step()
    bm = e.block_manager
    assert (bm.device_pool.num_free, bm.cache.num_evictable, bm.watermark_blocks) == (0, 8, 1)
    needing = {blocks: Sequence(f"{blocks} blocks", list(range(300, 300 + 2 * blocks)), SamplingParams(), 2, 3.0)
               for blocks in (7, 8)}  # 8 can be handed out, 1 of them the watermark's
    assert {blocks: bm.can_admit(seq, [], 2 * blocks, True) for blocks, seq in needing.items()} == {7: True, 8: False}
    e.add("C", Request([200, 201], 2, arrival=2))
    e.step()
    assert [seq.request_id for seq, _ in e.last_plan.scheduled] == ["B", "C"]
    check_invariants(e)


def test_the_model_free_engine_refuses_a_piece_of_the_wrong_kind_as_the_engine_does():
    from kvlib.core.block_allocator import BlockAllocator
    with pytest.raises(TypeError, match="allocator must be a class or factory.*pass the class itself"):
        ModelFreeEngine(EngineConfig(block_size=BS, num_gpu_blocks=4), allocator=BlockAllocator(4))


def test_a_requester_with_no_block_of_its_own_is_still_its_own_last_resort():
    """Two samples sharing both blocks of a full pool: the one that must copy its last block before writing
    has no unique tail, yet it is offered (as the requester) and gives way; both finish."""
    from kvlib.core.preemption import LatestArrivalPolicy

    offered = []

    class Recording(LatestArrivalPolicy):
        def select_victim(self, candidates, shortfall):
            offered.append([(c.seq.request_id, c.is_requester, c.num_unique_tail_blocks) for c in candidates])
            return super().select_victim(candidates, shortfall)

    e = ModelFreeEngine(EngineConfig(block_size=BS, num_gpu_blocks=2, watermark=0.0), preemption_policy=Recording())
    e.add("r", Request([1, 2, 3, 4, 5, 6, 7], 2, n=2))  # 7 + 2 - 1 positions: two blocks per sample
    for _ in range(20):
        if not e.has_unfinished():
            break
        e.step()
        check_invariants(e)
    assert not e.has_unfinished() and [len(s.output_token_ids) for s in e.requests["r"]] == [2, 2]
    assert offered[0] == [("r", True, 0)]  # its sibling, not yet scheduled, has no unique tail either


def test_a_prompt_whose_prefix_is_in_use_is_admitted_on_the_room_its_new_blocks_need():
    """B shares A's two cached blocks while A runs, so it needs one new block, the pool's last."""
    e = ModelFreeEngine(EngineConfig(block_size=BS, num_gpu_blocks=4, watermark=0.0, enable_prefix_caching=True))
    prefix = list(range(1, 9))
    a = e.add("a", Request(prefix + [9], 3))
    e.step()  # A's prefill: blocks of 4, 4 and 1 tokens, the two full ones named in the cache
    b = e.add("b", Request(prefix + [20], 2, arrival=1))
    e.step()
    assert b.status is SequenceStatus.RUNNING and b.block_table.blocks[:2] == a.block_table.blocks[:2]
    assert e.block_manager.device_pool.num_free == 0


def test_auto_mode_tells_the_policy_what_each_victim_holds_and_gives_up():
    """In every preemption (the victim loop's and the release of paused holders), the candidate and the
    context agree with the sequence: its blocks, whether it runs, the blocks and computed tokens it gives up."""
    from kvlib.core.preemption import LatestArrivalPolicy

    seen = []

    class Checking(LatestArrivalPolicy):
        def choose_mode(self, victim, context):
            seq = victim.seq
            assert victim.num_blocks == len(seq.block_table)
            assert victim.running == (seq.status is SequenceStatus.RUNNING)
            assert victim.num_shared_blocks == e.block_manager.num_shared(seq)
            assert isinstance(victim.is_requester, bool) and isinstance(victim.running, bool)
            assert victim.running or victim.is_requester is False  # a paused holder never asked for blocks
            kept = victim.num_blocks - context.num_blocks
            assert 0 < context.num_blocks <= victim.num_blocks
            assert context.num_tokens == seq.num_computed_tokens - min(seq.num_computed_tokens, kept * 2)
            seen.append(victim.running)
            return "recompute"

    config = dict(block_size=2, num_gpu_blocks=6, num_cpu_blocks=0, preemption_mode="auto", partial_preemption=True,
                  max_num_batched_tokens=10, max_num_seqs=4, watermark=0.0)
    e = ModelFreeEngine(EngineConfig(**config), preemption_policy=Checking())
    requests = [Request([2, 2], 5, arrival=0), Request([2, 2, 4, 0, 4, 4, 1], 1, arrival=2),
                Request([2], 10, arrival=3), Request([4, 0, 1, 3, 2], 6, n=2, arrival=4)]
    for i, request in enumerate(requests):
        e.add(f"r{i}", request)
    for _ in range(60):
        if not e.has_unfinished():
            break
        e.step()
    assert not e.has_unfinished() and True in seen and False in seen  # running victims, and paused holders


class NoScans(list):
    """A queue that fails on any linear search: moving a sequence must find it by bisection."""

    def __contains__(self, item):
        raise AssertionError("a queue was scanned for a sequence")

    def remove(self, item):
        raise AssertionError("a queue was scanned to remove a sequence")

    def index(self, *args):
        raise AssertionError("a queue was scanned for an index")


def test_queueing_many_requests_finds_each_by_bisection_never_a_scan(monkeypatch):
    """16,000 add_request calls took 4.5-8 s, and 8x the requests 34-39x the time: a scan per move."""
    from kvlib.core import scheduler as scheduler_module
    e = engine(num_gpu_blocks=64, max_num_seqs=8)
    s = e.scheduler
    s.waiting, s.running, s.swapped = NoScans(), NoScans(), NoScans()
    keys = [0]

    def counted(seq):
        keys[0] += 1
        return (seq.arrival_time, seq.seq_id)
    monkeypatch.setattr(scheduler_module, "by_arrival", counted)
    rng = random.Random(0)
    count = 4096
    for i in range(count):  # arrivals out of order, as requests added later may have arrived earlier
        e.add(f"r{i}", Request([1, 2, 3], 2, arrival=rng.uniform(0, 100)))
    assert len(s.waiting) == count and keys[0] <= count * 2 * (count.bit_length() + 2)
    assert [seq.arrival_time for seq in s.waiting] == sorted(seq.arrival_time for seq in s.waiting)
    for _ in range(40):
        e.step()
        check_invariants(e)
    assert len(s.waiting) <= count - 40  # they were admitted, run and finished in order


def test_auto_mode_gives_the_policy_the_engines_cost_model_and_the_pools_state():
    """The context of an auto-mode choice carries what the scheduler was built with (the measured cost model,
    the block's bytes) and the state of the step: free host blocks, the running batch, what the victim gives up."""
    from kvlib.core.block_allocator import BlockAllocator
    from kvlib.core.block_manager import BlockManager
    from kvlib.core.plan import SchedulerOutput
    from kvlib.core.preemption import LatestArrivalPolicy

    measured, contexts = object(), []

    class Recording(LatestArrivalPolicy):
        def choose_mode(self, victim, context):
            contexts.append((victim.seq.request_id, context))
            return "swap"

    config = EngineConfig(block_size=2, num_gpu_blocks=2, num_cpu_blocks=4, preemption_mode="auto", watermark=0.0)
    bm = BlockManager(2, BlockAllocator(2), BlockAllocator(4))
    scheduler = Scheduler(config, bm, Recording(), block_bytes=123, cost_model=measured)
    for i in range(2):
        scheduler.add(Sequence(f"r{i}", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True), 2, float(i)))
    plan = scheduler.schedule(SchedulerOutput())  # both prefill into one block each: the pool is full
    scheduler.postprocess(plan, [7] * len(plan.draws), now=0.0)
    assert contexts == []
    scheduler.schedule(SchedulerOutput())  # r0 needs a second block: the newest, r1, gives its one up
    [(victim, context)] = contexts
    assert victim == "r1" and context.cost_model is measured and context.block_bytes == 123
    assert (context.num_blocks, context.num_tokens, context.num_host_blocks) == (1, 2, 1)
    assert context.host_free_blocks == 4 and context.batch_tokens == 2


def test_the_host_room_a_policy_sees_counts_the_host_prefix_tier_blocks_a_swap_would_evict():
    """A swap evicts host-tier prefix blocks for room (``make_host_room``): with all 4 host blocks in the tier, a
    policy told "none free" would recompute a victim whose swap had room."""
    from kvlib.core.block_allocator import BlockAllocator
    from kvlib.core.block_manager import BlockManager
    from kvlib.core.plan import SchedulerOutput
    from kvlib.core.preemption import LatestArrivalPolicy

    contexts = []

    class Recording(LatestArrivalPolicy):
        def choose_mode(self, victim, context):
            contexts.append(context)
            return "swap"

    config = EngineConfig(block_size=2, num_gpu_blocks=2, num_cpu_blocks=4, preemption_mode="auto", watermark=0.0,
                          enable_prefix_caching=True, host_prefix_cache=True)
    bm = BlockManager(2, BlockAllocator(2), BlockAllocator(4), enable_prefix_caching=True, host_prefix_cache=True)
    for name in range(4):
        bm.host_tier.put(1000 + name, (9, name), bm.host_pool.allocate())
    scheduler = Scheduler(config, bm, Recording(), block_bytes=1, cost_model=object())
    for i in range(2):
        scheduler.add(Sequence(f"r{i}", [1, 2 + i], SamplingParams(max_tokens=3, ignore_eos=True), 2, float(i)))
    plan = scheduler.schedule(SchedulerOutput())
    scheduler.postprocess(plan, [7] * len(plan.draws), now=0.0)
    plan = scheduler.schedule(SchedulerOutput())  # r0 needs a second block: r1 gives its one up
    [context] = contexts
    assert (context.num_host_blocks, context.host_free_blocks) == (1, 4)
    assert [p.mode for p in plan.preemptions] == ["swap"] and bm.host_tier.num_cached == 3  # one evicted for it


def one_step_scheduler(max_model_len=None, max_num_seqs=256) -> Scheduler:
    from kvlib.core.block_allocator import BlockAllocator
    from kvlib.core.block_manager import BlockManager
    from kvlib.core.preemption import LatestArrivalPolicy

    config = EngineConfig(block_size=2, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0, max_num_seqs=max_num_seqs)
    return Scheduler(config, BlockManager(2, BlockAllocator(8), BlockAllocator(0)), LatestArrivalPolicy(),
                     block_bytes=1, eos_token_ids=frozenset({2}), max_model_len=max_model_len)


@pytest.mark.parametrize("token, params, max_model_len, reason", [
    (2, dict(max_tokens=5), None, "stop"),                           # the model's end of sequence
    (5, dict(max_tokens=5), None, None),                             # any other token goes on
    (2, dict(max_tokens=5, ignore_eos=True), None, None),            # asked to go on past it
    (7, dict(max_tokens=5, ignore_eos=True, stop_token_ids=[7]), None, "stop"),  # a stop token stops regardless
    (5, dict(max_tokens=1), None, "length"),                         # the one token asked for
    (5, dict(max_tokens=5), 4, "length"),                            # 3 prompt tokens + 1 reach max_model_len
    (5, dict(max_tokens=5), 5, None),
])
def test_a_sampled_token_finishes_a_request_for_exactly_one_reason(token, params, max_model_len, reason):
    from kvlib.core.plan import SchedulerOutput

    scheduler = one_step_scheduler(max_model_len)
    seq = Sequence("r", [1, 3, 4], SamplingParams(**params), 2, 0.0)
    scheduler.add(seq)
    result = scheduler.postprocess(scheduler.schedule(SchedulerOutput()), [token], now=1.0)
    assert seq.finish_reason == reason and result.sampled == [seq]
    assert result.finished == ([seq] if reason else []) and (seq.status is SequenceStatus.FINISHED) == bool(reason)


@pytest.mark.parametrize("max_num_seqs, left", [(1, 100 - 3), (2, 100 - 3 - 5), (3, 100 - 3 - 5)])
def test_resuming_waiting_sequences_returns_the_budget_left_whichever_limit_stopped_it(max_num_seqs, left):
    from kvlib.core.plan import SchedulerOutput

    scheduler = one_step_scheduler(max_num_seqs=max_num_seqs)
    for i, prompt in enumerate(([1, 3, 4], [1, 3, 4, 5, 6])):
        scheduler.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=2), 2, float(i)))
    out = SchedulerOutput()
    assert scheduler.schedule_waiting(out, 100) == left
    assert len(out.scheduled) == min(2, max_num_seqs)


def test_each_sampled_token_is_stamped_with_its_steps_time():
    """TTFT and the longest gap between tokens come from the times postprocess is given."""
    from kvlib.core.plan import SchedulerOutput

    scheduler = one_step_scheduler(None)
    seq = Sequence("r", [1, 3, 4], SamplingParams(max_tokens=5, ignore_eos=True), 2, 0.0)
    scheduler.add(seq)
    for now in (1.0, 1.5, 3.5):
        scheduler.postprocess(scheduler.schedule(SchedulerOutput()), [5], now=now)
    assert (seq.first_token_time, seq.last_token_time, seq.max_inter_token_latency) == (1.0, 3.5, 2.0)
