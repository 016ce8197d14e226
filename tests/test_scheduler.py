"""The scheduler with no model: exact queues and block counts after each step (the model-free driver)."""
import pytest

from kvlib.core.model_free import ModelFreeEngine
from kvlib.core.model_free import Request
from kvlib.config import EngineConfig
from kvlib.core.invariants import check_invariants
from kvlib.core.sequence import SequenceStatus


def engine(**config) -> ModelFreeEngine:
    return ModelFreeEngine(EngineConfig(**{"block_size": 4, "watermark": 0.0, **config}))


def status(e: ModelFreeEngine, request_id: str) -> str:
    return e.requests[request_id][0].status.value


def blocks(e: ModelFreeEngine, request_id: str) -> int:
    return len(e.requests[request_id][0].block_table)


def scheduled(e: ModelFreeEngine) -> dict:
    return {f"{seq.request_id}/{seq.sample_index}": n for seq, n in e.last_plan.scheduled}


def check(e: ModelFreeEngine) -> None:
    check_invariants(e)


def test_continuous_batching_admits_oldest_first_within_the_budget():
    e = engine(num_gpu_blocks=32, max_num_batched_tokens=10)
    e.add("a", Request(list(range(8)), 3, arrival=0))
    e.add("b", Request(list(range(8)), 3, arrival=1))
    e.step()
    assert scheduled(e) == {"a/0": 8, "b/0": 2}  # b's prefill starts in the budget a left
    e.step()
    assert scheduled(e) == {"a/0": 1, "b/0": 6}
    e.step()
    assert scheduled(e) == {"a/0": 1, "b/0": 1}
    e.step()
    assert scheduled(e) == {"b/0": 1} and status(e, "a") == "finished"
    check(e)


def test_max_num_seqs_holds_back_the_next_request():
    e = engine(num_gpu_blocks=32, max_num_seqs=1)
    e.add("a", Request([1, 2, 3], 2, arrival=0))
    e.add("b", Request([4, 5, 6], 2, arrival=1))
    e.step()
    assert scheduled(e) == {"a/0": 3} and status(e, "b") == "waiting"
    e.step()
    e.step()
    assert scheduled(e) == {"b/0": 3}


def test_the_watermark_delays_admission_but_not_a_request_alone():
    e = engine(num_gpu_blocks=10, watermark=0.2)  # 2 blocks kept free
    e.add("a", Request(list(range(20)), 4, arrival=0))  # 5 blocks
    e.add("b", Request(list(range(16)), 4, arrival=1))  # 4 blocks: 10 - 5 - 4 = 1 < 2 free
    e.step()
    assert scheduled(e) == {"a/0": 20} and status(e, "b") == "waiting"
    while status(e, "a") != "finished":
        e.step()
    e.step()
    assert "b/0" in scheduled(e)


def test_recompute_preempts_the_newest_and_it_comes_back_first_in_line():
    e = engine(num_gpu_blocks=4, max_num_batched_tokens=64)
    e.add("old", Request(list(range(7)), 6, arrival=0))  # 2 blocks, grows into a third at token 9
    e.add("new", Request(list(range(7)), 6, arrival=1))
    e.step()
    assert blocks(e, "old") == 2 and blocks(e, "new") == 2
    e.step()  # token 8 fits in block 2
    e.step()  # old needs its third block: none is free, new is the newest
    assert status(e, "new") == "waiting" and blocks(e, "new") == 0 and blocks(e, "old") == 3
    assert e.metrics.num_preemptions_recompute == 1 and e.metrics.num_recomputed_tokens == 8
    while status(e, "old") != "finished":
        e.step()
        check(e)
    e.step()
    assert scheduled(e) == {"new/0": 9}  # its whole context (prompt and two tokens), prefilled again


def test_swap_preempts_to_the_host_and_swaps_back_in():
    e = engine(num_gpu_blocks=4, num_cpu_blocks=8, preemption_mode="swap")
    e.add("old", Request(list(range(7)), 6, arrival=0))
    e.add("new", Request(list(range(7)), 6, arrival=1))
    for _ in range(3):
        e.step()
    assert status(e, "new") == "swapped" and len(e.requests["new"][0].host_blocks) == 2
    assert e.metrics.num_swapped_out_blocks == 2 and e.block_manager.host_pool.num_used == 2
    while status(e, "old") != "finished":
        e.step()
    e.step()
    assert status(e, "new") == "running" and e.metrics.num_swapped_in_blocks == 2
    assert scheduled(e) == {"new/0": 1}  # no recomputation: it continues where it stopped
    assert e.block_manager.host_pool.num_used == 0


def test_partial_preemption_takes_only_the_shortfall_from_the_tail():
    e = engine(num_gpu_blocks=6, preemption_mode="recompute", partial_preemption=True, max_num_batched_tokens=64)
    e.add("big", Request(list(range(16)), 8, arrival=1))  # 4 blocks, the newest
    e.add("small", Request(list(range(3)), 8, arrival=0))  # 1 block, needs a second at token 5
    e.step()
    assert blocks(e, "big") == 4 and blocks(e, "small") == 1  # 5 of 6 blocks
    e.step()
    assert blocks(e, "big") == 5  # its 17th token opened a fifth block: the pool is full
    e.step()  # small needs a block at position 4: big gives up one, its tail
    assert status(e, "big") == "waiting" and blocks(e, "big") == 4
    assert e.metrics.num_recomputed_tokens == 1 and e.metrics.num_preemptions == 1
    check(e)


def test_samples_reserve_their_places_and_fork_after_the_prompt():
    e = engine(num_gpu_blocks=32, max_num_seqs=3)
    e.add("p", Request(list(range(6)), 3, n=3, arrival=0))
    e.add("q", Request([1, 2], 3, arrival=1))
    e.step()
    assert scheduled(e) == {"p/0": 6} and status(e, "q") == "waiting"  # p will be three sequences
    assert len(e.requests["p"]) == 3 and e.metrics.num_cow_copies == 0
    e.step()
    assert scheduled(e) == {"p/0": 1, "p/1": 1, "p/2": 1}
    assert e.metrics.num_cow_copies == 2  # the shared, partly filled last block: one copy each but the last
    assert len(e.scheduler.running) == 3


def test_a_request_that_can_never_fit_is_refused_before_it_runs():
    e = engine(num_gpu_blocks=4)
    seq = e.add("huge", Request(list(range(20)), 1))
    assert "raise num_gpu_blocks" in e.scheduler.why_never(seq)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_many_growing_requests_all_finish(mode):
    e = engine(num_gpu_blocks=10, num_cpu_blocks=40, preemption_mode=mode, max_num_batched_tokens=8)
    for i in range(6):
        e.add(f"r{i}", Request([i] * (3 + i), 12, arrival=i))
    steps = 0
    while e.has_unfinished():
        e.step()
        check(e)
        steps += 1
        assert steps < 1000
    assert all(s.status is SequenceStatus.FINISHED and len(s.output_token_ids) == 12
               for seqs in e.requests.values() for s in seqs)
    assert e.metrics.num_preemptions > 0
