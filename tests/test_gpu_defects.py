"""What the first GPU run would have hit (issue 23), reproduced on a CPU: each test fails on the code before its fix."""
import pytest
import torch
import transformers

import kvlib.cli.bench.engine as bench_engine
from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.cli.bench.engine import Placement, make_workload, run_kvlib, run_transformers
from kvlib.runner.warm_up import prefill_blocks, warm_up


@pytest.mark.parametrize("block_size, num_blocks", [(1, 1), (1, 8), (2, 4), (16, 4)])
def test_the_warm_up_runs_at_every_block_size(block_size, num_blocks):
    llm = LLM("default", EngineConfig(block_size=block_size, num_gpu_blocks=num_blocks, num_cpu_blocks=2),
              verbose=False)
    warm_up(llm.engine.runner)  # the GPU's warm-up, here on CPU tensors: block_size 1 raised IndexError
    out = llm.generate([[5]], SamplingParams(max_tokens=1))[0]  # the engine serves on
    assert len(out.token_ids) == 1


def test_warm_up_blocks_hold_their_tokens():
    assert prefill_blocks(2, 1, 8) == [0, 1]
    assert prefill_blocks(2, 1, 1) == [0, 0]
    assert prefill_blocks(2, 16, 4) == [0]
    assert prefill_blocks(33, 16, 2) == [0, 1, 0]


def test_bench_engine_builds_only_the_engines_it_measures(checkpoint, monkeypatch, capsys):
    built = []
    real_llm = bench_engine.LLM

    def recorded(folder, config, **kwargs):
        built.append(config.block_size)
        return real_llm(folder, config, **kwargs)
    monkeypatch.setattr(bench_engine, "LLM", recorded)
    assert bench_engine.main(["--model", str(checkpoint("llama-gqa")), "--requests", "2", "--scale", "0.02",
                              "--budget", "256", "--block-size", "4"]) == 0
    assert built == [4]  # it read the vocabulary from config.json, not from a one-block engine of block size 1
    assert "both engines on cpu, float32" in capsys.readouterr().out


def test_transformers_runs_on_kvlibs_device_and_dtype(checkpoint, monkeypatch):
    folder = checkpoint("llama-gqa")
    loaded = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def from_pretrained(*args, **kwargs):
        model = real(*args, **kwargs)
        loaded.append(model)
        return model
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    requests = make_workload(2, 0.02, 1000.0, vocab_size=96)
    placement = Placement(torch.device("cpu"), torch.bfloat16)
    budget = 2 * max(len(r.prompt) + r.max_tokens for r in requests)
    row = run_transformers(folder, requests, budget, placement)
    assert next(loaded[0].parameters()).dtype == torch.bfloat16  # was float32 whatever kvlib ran
    assert (row["device"], row["dtype"]) == ("cpu", "bfloat16")
    kvlib_row = run_kvlib(folder, requests, budget, block_size=4, placement=Placement(torch.device("cpu"), torch.float32))
    assert (kvlib_row["device"], kvlib_row["dtype"]) == ("cpu", "float32")


def test_placement_auto_is_kvlibs_own_choice():
    llm = LLM("default", EngineConfig(num_gpu_blocks=4), verbose=False)
    auto = Placement.auto()
    assert (auto.device.type, auto.dtype) == (llm.engine.device.type, llm.engine.dtype)


def test_kernel_bench_times_the_engines_dtype_then_float16(monkeypatch):
    """On a GPU of compute capability 9.0 the engine serves bfloat16: the bench's first rows are bfloat16 (it timed
    float16 only), float16 follows."""
    import triton.testing

    from kvlib.cli.bench import kernels as bench
    from kvlib.kernels import paged_decode
    timed = []

    def fake_case(batch, context, device, dtype):
        timed.append(dtype)
        return (lambda splits: None), (lambda: None), 2 * batch * context
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(bench, "decode_case", fake_case)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, return_mode: fn() or 1.0)
    monkeypatch.setattr(paged_decode, "choose_num_splits", lambda *args: 1)
    rows = bench.run_kernel_bench()
    per_dtype = len(rows) // 2
    assert [r["dtype"] for r in rows] == ["bfloat16"] * per_dtype + ["float16"] * per_dtype
    assert timed == [torch.bfloat16] * len(bench.SHAPES) + [torch.float16] * len(bench.SHAPES)
    assert bench.bench_dtypes(torch.float16) == [torch.float16]
