"""The engine with the Triton backend produces the torch backend's greedy tokens.

On a CPU the kernels run under the Triton interpreter (kvlib sets TRITON_INTERPRET=1 before
Triton is imported), so the checkpoint and the workload are tiny. The engines run in float32, so on a
GPU too both backends compute the same numbers up to rounding and greedy tokens must be equal.
"""
import pytest

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7], [1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5]]


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-bias-tied"])
def test_triton_engine_matches_torch_engine(arch, checkpoint):
    def run(backend, **extra):
        config = EngineConfig(block_size=4, num_gpu_blocks=64, attention_backend=backend, dtype="float32", **extra)
        llm = LLM(checkpoint(arch), config, verbose=False)
        return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6))], llm

    expected, _ = run("torch")
    tokens, llm = run("triton")
    assert llm.engine.runner.backend.name == "triton"
    assert tokens == expected


def test_triton_copy_on_write_and_prefix_cache(checkpoint):
    """Parallel samples exercise the Triton block-copy kernel; prefix hits the paged prefill."""
    def run(backend):
        config = EngineConfig(block_size=4, num_gpu_blocks=64, attention_backend=backend, enable_prefix_caching=True,
                              dtype="float32", max_num_seqs=2)  # one request at a time: the second finds the first cached
        llm = LLM(checkpoint("llama-gqa"), config, verbose=False)
        outs = llm.generate([PROMPTS[2], PROMPTS[2] + [7]], SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=3))
        return [[s.token_ids for s in o.samples] for o in outs], llm.metrics

    expected, _ = run("torch")
    samples, metrics = run("triton")
    assert samples == expected
    assert metrics.num_cow_copies > 0 and metrics.prefix_cache_hit_tokens > 0
