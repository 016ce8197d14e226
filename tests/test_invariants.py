"""The bookkeeping checker every engine test and grader leans on: it names the first broken rule, and
``serve_checked`` the step that broke it. A checker that stays quiet, or names the wrong block, would let
every other test pass over a leak."""
import pytest

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.core.invariants import InvariantError, StalledError, check_invariants, serve_checked


@pytest.fixture
def llm(checkpoint):
    return LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8),
               verbose=False)


def running(llm):
    """One request admitted and a step run: its sequence, holding two device blocks."""
    llm.engine.add_request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=4))
    llm.engine.step()
    seq = llm.engine.scheduler.running[0]
    assert len(seq.block_table.blocks) == 2
    check_invariants(llm.engine)  # the rules hold before each test breaks one
    return seq


def test_a_reference_nobody_holds_is_named_with_its_block_and_counts(llm):
    block = running(llm).block_table.blocks[0]
    llm.engine.block_manager.device_pool.fork(block)
    with pytest.raises(InvariantError, match=rf"^device block {block}: reference count 2 but 1 owners$"):
        check_invariants(llm.engine)


def test_a_host_block_taken_by_nobody_is_named(llm):
    running(llm)
    host = llm.engine.block_manager.host_pool.allocate()
    with pytest.raises(InvariantError, match=rf"^host block {host}: reference count 1 but 0 owners$"):
        check_invariants(llm.engine)


def test_a_free_count_the_reference_counts_contradict(llm):
    running(llm)
    pool = llm.engine.block_manager.device_pool
    pool._free.append(pool._free[0])  # one id twice on the free list
    with pytest.raises(InvariantError, match=r"^device pool: 14 blocks have no owner but the allocator reports 15 free$"):
        check_invariants(llm.engine)


def test_more_running_sequences_than_allowed(llm):
    running(llm)
    llm.engine.scheduler.config.max_num_seqs = 0
    with pytest.raises(InvariantError, match=r"^1 sequences run \(or will, once they fork\), more than max_num_seqs=0$"):
        check_invariants(llm.engine)


def test_serve_checked_returns_outputs_in_prompt_order_with_each_prompts_parameters(llm):
    outputs = serve_checked(llm, [[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=3)],
                            max_steps=100)
    assert [(o.prompt_token_ids, len(o.token_ids)) for o in outputs] == [([1, 2, 3], 2), ([4, 5], 3)]
    shared = serve_checked(llm, [[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2), max_steps=100)
    assert [len(o.token_ids) for o in shared] == [2, 2]


def test_serve_checked_names_the_step_that_broke_a_rule(llm):
    engine, step, steps = llm.engine, llm.engine.step, []

    def step_that_leaks_on_the_third():
        outputs = step()
        steps.append(len(steps) + 1)
        if len(steps) == 3:
            engine.block_manager.device_pool.allocate()
        return outputs
    engine.step = step_that_leaks_on_the_third
    with pytest.raises(InvariantError, match=r"^after engine step 3: device block \d+: reference count 1 but 0 owners$"):
        serve_checked(llm, [[1, 2, 3]], SamplingParams(max_tokens=8), max_steps=100)


def test_serve_checked_stops_an_engine_that_does_not_finish(llm):
    with pytest.raises(StalledError, match=r"^requests were still unfinished after 2 engine steps$"):
        serve_checked(llm, [[1, 2, 3]], SamplingParams(max_tokens=10), max_steps=2)


def test_room_for_fewer_tokens_than_a_sequence_claims_to_have_computed(llm):
    seq = running(llm)
    seq.num_computed_tokens = 9  # two blocks of 4 hold 8
    with pytest.raises(InvariantError, match=rf"^sequence {seq.seq_id} claims 9 computed tokens but holds room for fewer$"):
        check_invariants(llm.engine)


def test_used_and_free_blocks_that_do_not_add_up_to_the_pool(llm, monkeypatch):
    running(llm)
    pool = llm.engine.block_manager.device_pool
    monkeypatch.setattr(type(pool), "num_used", property(lambda self: 0))
    with pytest.raises(InvariantError, match=r"^device pool: free 14 \+ used 0 != 16$"):
        check_invariants(llm.engine)


def test_swapped_sequences_and_the_host_tier_own_their_host_blocks(checkpoint):
    """A pool that swaps, with prefix caching on the host tier: the checker counts both as owners of host blocks
    (checked after every step) and raises nothing."""
    config = EngineConfig(block_size=4, num_gpu_blocks=10, num_cpu_blocks=32, preemption_mode="swap", watermark=0.0,
                          enable_prefix_caching=True, host_prefix_cache=True)
    llm = LLM(checkpoint("llama-gqa"), config, verbose=False)
    prompts = [[7, 7, 7, 7, 1, 2, 3, 4, 5], [7, 7, 7, 7, 6, 5], [9, 8, 7, 6, 5, 4, 3], [7, 7, 7, 7, 1, 2, 3, 4, 6]]
    swapped_with_host_blocks = []
    step = llm.engine.step

    def watched_step():
        outputs = step()
        s = llm.engine.scheduler
        swapped_with_host_blocks.append(any(seq.host_blocks for seq in s.swapped))
        return outputs
    llm.engine.step = watched_step
    serve_checked(llm, prompts, SamplingParams(max_tokens=12), max_steps=1000)
    assert any(swapped_with_host_blocks) and llm.metrics.num_preemptions_swap > 0
    assert llm.engine.block_manager.host_tier.num_cached > 0
