"""A CPU decode step's work in torch calls does not grow with the batch: no per-sequence loop in the forward,
attention or sampling, so at small batches the step costs what its operations cost, once."""
from collections import Counter

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from kvlib import LLM, EngineConfig, SamplingParams


class CountedOps(TorchDispatchMode):
    """Counts every torch operation dispatched while it is active, by name."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def decode_step_ops(batch: int, weight_format: str = "float32") -> Counter:
    """The torch operations of one decode step of ``batch`` sequences of different lengths, greedy."""
    llm = LLM("default", EngineConfig(device="cpu", num_gpu_blocks=128, max_num_seqs=16, weight_format=weight_format),
              verbose=False)
    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"r{i}", list(range(3 + i, 20 + 3 * i)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # the prefills
    engine.step()
    with CountedOps() as counted:
        outputs = engine.step()
    assert len(outputs) == batch and all(len(out.token_ids) == 3 for out in outputs), "a decode step of every sequence"
    return counted.ops


@pytest.mark.parametrize("weight_format", ["float32", "bfloat16"])
def test_a_decode_step_runs_as_many_torch_ops_at_any_batch(weight_format):
    one = decode_step_ops(1, weight_format)
    assert one["aten.linear.default"] + one["mkldnn._linear_pointwise.default"] > 0, "the counter sees the model"
    for batch in (4, 13):
        assert decode_step_ops(batch, weight_format) == one, f"batch {batch} dispatched other ops than batch 1"
