"""Decode steps replayed from graphs, on the CPU twin of a CUDA graph (``EagerCapture``).

The twin replays by calling the recorded step again on the same buffers and the same metadata
object, keeping whatever the host computed while recording, as a real graph does. The Triton
backend (interpreted here) reads everything from the buffers, so replays give the eager tokens; the
torch backend plans its reads on the host, so the twin shows why it is never captured.
"""
import pytest
import torch

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.kernels import triton_available
from kvlib.runner.decode_graphs import DecodeGraphs, EagerCapture, batch_buckets, graph_safe
from kvlib.runner.step_inputs import Chunk

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7], [1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5], [6], [5, 3, 5]]


def test_buckets_are_powers_of_two_then_multiples_of_16():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]


def serve(llm, params):
    """Requests join two steps apart, so decode batches grow and shrink; returns tokens by request."""
    engine, done, pending = llm.engine, {}, list(enumerate(PROMPTS))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [s.token_ids for s in out.samples]
        steps += 1
    return done


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=7), SamplingParams(max_tokens=8, n=2, temperature=1.0,
                                                                                   seed=4)])
def test_graph_replays_give_the_eager_tokens(checkpoint, params):
    def engine(graphs: bool):
        config = EngineConfig(block_size=4, num_gpu_blocks=9, num_cpu_blocks=32, preemption_mode="swap", watermark=0.0,
                              max_num_seqs=6, attention_backend="triton")
        llm = LLM(checkpoint("llama-gqa"), config, verbose=False)
        if graphs:
            llm.engine.runner.set_decode_graphs(EagerCapture())
        return llm

    eager, graphed = engine(False), engine(True)
    replays = []
    run = graphed.engine.runner.graphs.run
    graphed.engine.runner.graphs.run = lambda chunks: replays.append(len(chunks)) or run(chunks)
    assert serve(graphed, params) == serve(eager, params)
    assert len(set(replays)) >= 3  # several batch sizes, several buckets
    assert graphed.metrics.num_preemptions > 0  # swapped blocks came back under replayed steps too


def test_only_the_triton_backend_is_captured(checkpoint):
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=16), verbose=False)
    assert not graph_safe(llm.engine.runner.backend)


def test_the_twin_keeps_what_the_host_computed_while_recording(checkpoint):
    """The torch backend's decode plan is made on the host from the lengths, so a replay reuses the old plan."""
    llm = LLM(checkpoint("llama-gqa"), EngineConfig(block_size=4, num_gpu_blocks=16), verbose=False)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.device_pool, runner.backend, runner.buffers, 64, [1], EagerCapture())
    longer = [Chunk([7], 9, [3, 5, 6], sampled=True)]  # context 10: three blocks, where the recording read one
    replayed = graphs.run(longer)
    inputs = runner.buffers.pack(longer)
    eager = runner.model(inputs.token_ids, inputs.positions, runner.device_pool, inputs.meta, runner.backend,
                         inputs.logits_rows)
    assert not torch.allclose(replayed, eager)
