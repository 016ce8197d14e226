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
