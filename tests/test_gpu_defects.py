"""What the first GPU run would have hit (issue 23), reproduced on a CPU: each test fails on the code before its fix."""
import gc

import pytest
import torch
import transformers
from torch.overrides import TorchFunctionMode

import kvlib.cli.bench.engine as bench_engine
from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.cli.bench.engine import Placement, make_workload, run_kvlib, run_transformers
from kvlib.core.plan import BlockMoves
from kvlib.runner.block_transfer import PinnedIds
from kvlib.runner.kv_cache import KVCachePool, KVCacheSpec, copy_blocks_between, pinned_zeros, torch_pinned_bytes
from kvlib.runner.streams import HostStream, HostStreams, SpanTimer
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


class ManualEvent:
    """An event whose work is done when the test says, at the time the test gives."""

    def __init__(self, clock: list):
        self.time, self.finished = clock[0], False
        clock[0] += 1.0

    def done(self) -> bool:
        return self.finished

    def seconds_until(self, later) -> float:
        assert self.finished and later.finished, "a time read before its events happened"
        return later.time - self.time


class ManualStream(HostStream):
    def __init__(self, clock: list, events: list):
        self.clock, self.events = clock, events

    def record(self, timing: bool = False):
        self.events.append(ManualEvent(self.clock))
        return self.events[-1]


def test_move_time_is_read_from_events_once_they_are_done():
    """On a GPU the host only issues the copies: their time is the events', read once done (it was the host's
    time to issue them, counted in the same step)."""
    llm = LLM("default", EngineConfig(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8), verbose=False)
    runner, clock, events = llm.engine.runner, [10.0], []
    streams = HostStreams()
    streams.compute, streams.copy = ManualStream(clock, events), ManualStream(clock, events)
    runner.move_timer = SpanTimer(streams)
    assert runner.execute_moves(BlockMoves(copies=[(0, 1)], swap_out=[(2, 3)])) == 0.0  # copies still running
    start, compute_end, copy_end = events
    compute_end.finished = start.finished = True
    assert runner.execute_moves(BlockMoves()) == 0.0  # the copy stream's part is still crossing the link
    copy_end.finished = True
    assert runner.execute_moves(BlockMoves()) == copy_end.time - start.time  # until the later of its two ends
    assert runner.execute_moves(BlockMoves()) == 0.0  # counted once


def test_move_time_on_a_cpu_is_the_moves_own_wall_time():
    llm = LLM("default", EngineConfig(block_size=4, num_gpu_blocks=12, num_cpu_blocks=64, preemption_mode="swap",
                                      watermark=0.0), verbose=False)
    llm.generate([[7] * 20] * 4, SamplingParams(max_tokens=24, ignore_eos=True))
    assert llm.metrics.num_swapped_out_blocks > 0 and llm.metrics.swap_time > 0
    assert not llm.engine.runner.move_timer.pending


class ListToDevice(TorchFunctionMode):
    """Notes every device tensor built from a Python list: a blocking copy from pageable memory on a GPU."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and isinstance(args[0], (list, tuple)) and "device" in kwargs:
            self.seen.append(f"{func.__name__} of a list")
        if func is torch.Tensor.__getitem__ and isinstance(args[1], list):
            self.seen.append("indexing with a list")
        return func(*args, **kwargs)


def test_copy_on_write_and_forked_samples_build_no_device_tensor_from_a_list(monkeypatch):
    llm = LLM("default", EngineConfig(block_size=4, num_gpu_blocks=64), verbose=False)
    runner, mode = llm.engine.runner, ListToDevice()
    for name in ("execute_moves", "sample"):
        method = getattr(runner, name)

        def watched(*args, method=method):
            with mode:
                return method(*args)
        monkeypatch.setattr(runner, name, watched)
    out = llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=3))[0]
    assert llm.metrics.num_cow_copies > 0 and len(out.samples) == 3
    assert mode.seen == []


def test_pinned_ids_rows_upload_what_was_written():
    ids = PinnedIds(2, 8, torch.device("cpu"), HostStreams())
    assert ids.upload(0, [3, 1, 4]).tolist() == [3, 1, 4]
    assert ids.upload(1, [2]).tolist() == [2]
    assert ids.upload(0, [5, 9]).tolist() == [5, 9]
    with pytest.raises(ValueError, match="9 ids do not fit a row of 8"):
        ids.upload(1, list(range(9)))


class FakeCudart:
    def __init__(self, fail: bool = False):
        self.fail, self.registered, self.unregistered = fail, [], []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - CUDA's name
        self.registered.append((ptr, size))
        return 1 if self.fail else 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_the_host_pool_pins_exactly_its_size(monkeypatch):
    """torch's pinned allocator would pin the next power of two: 40 GiB asked, 64 GiB pinned."""
    assert torch_pinned_bytes(40 * 2**30) == 64 * 2**30 and torch_pinned_bytes(2**20) == 2**20
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)  # what CUDA says of registered memory
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=5, dtype=torch.bfloat16)
    pool = KVCachePool(spec, 37, "cpu", pin_memory=True)
    assert pool.pinned_bytes == 37 * spec.block_bytes == pool.data.nbytes  # not rounded up to a power of two
    ptr, size = cudart.registered[0]
    assert (ptr, size) == (pool.data.data_ptr(), pool.pinned_bytes) and ptr % 4096 == 0
    assert pool.data.shape == (37, 3, 2, 5, 2, 8) and pool.data.dtype == torch.bfloat16
    assert pool.data.is_contiguous() and not pool.data.any()
    other = KVCachePool(spec, 37, "cpu")
    other.data.copy_(torch.randn(other.data.shape).to(torch.bfloat16))
    copy_blocks_between(other, pool, [3, 30, 0], [36, 0, 7])  # one pool: blocks by offset from its start
    assert torch.equal(pool.data[[36, 0, 7]], other.data[[3, 30, 0]])
    view = pool.layer(1)[0]
    del pool
    gc.collect()
    assert cudart.unregistered == []  # a view still reads the memory
    del view
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_a_failed_registration_falls_back_to_torchs_allocator(monkeypatch):
    cudart, asked = FakeCudart(fail=True), []
    real_zeros = torch.zeros

    def zeros(*shape, **kwargs):
        asked.append(kwargs.pop("pin_memory", False))
        return real_zeros(*shape, **kwargs)
    monkeypatch.setattr(torch, "zeros", zeros)
    tensor, pinned = pinned_zeros((3, 1000), torch.float32, cudart)
    assert asked == [True] and pinned == torch_pinned_bytes(12000) == 16384 and tensor.shape == (3, 1000)


def test_a_graph_bucket_spreads_real_contexts_over_every_split():
    """A decode graph's bound is max_model_len: 131,072 tokens. A batch of 8 at 4k tokens, 8 kv heads, on an H200
    holding 3 programs per SM: the rule gives 6 splits, and every split of every sequence holds context (the split
    length was fixed by the bound, so each context fit in its first split: 64 programs worked of 384)."""
    from kvlib.kernels import paged_decode
    H200 = type("Props", (), {"multi_processor_count": 132})
    import unittest.mock
    with unittest.mock.patch.object(torch.cuda, "get_device_properties", lambda device: H200):
        splits = paged_decode.choose_num_splits(8, 8, 131072, torch.device("cuda"), per_sm=3)
    assert splits == 6
    assert paged_decode.working_splits(4096, splits) == splits  # each 4k context in 6 splits of 688 tokens
    assert paged_decode.working_splits(300, splits) == 2  # a short one: splits of at least 256 tokens
    assert paged_decode.working_splits(4096, 3, min_split=16) == 3


def test_occupancy_comes_from_registers_and_shared_memory():
    """The issue's compile: 108-141 registers and 70 KiB of shared memory at 4 warps fit 3 programs per SM on an H100
    or H200, not the 4 the rule assumed."""
    from kvlib.kernels.paged_decode import programs_per_sm
    hopper = type("Props", (), {"max_threads_per_multi_processor": 2048, "regs_per_multiprocessor": 65536,
                                "shared_memory_per_multiprocessor": 228 * 1024})
    assert programs_per_sm(141, 70 * 1024, 4, hopper) == 3  # registers: 14 warps of 141; shared: 3 x 71 KiB
    assert programs_per_sm(108, 70 * 1024, 4, hopper) == 3  # registers allow 4, shared memory 3
    assert programs_per_sm(79, 37 * 1024, 4, hopper) == 6  # the BLOCK_N 32 compile
    assert programs_per_sm(32, 0, 4, hopper) == 16  # threads: 2048 / 128
    assert programs_per_sm(255, 0, 8, hopper) == 1


def test_the_occupancy_of_a_launched_kernel_is_recorded(monkeypatch):
    from kvlib.kernels import paged_decode
    hopper = type("Props", (), {"max_threads_per_multi_processor": 2048, "regs_per_multiprocessor": 65536,
                                "shared_memory_per_multiprocessor": 228 * 1024})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: hopper)
    monkeypatch.setattr(paged_decode, "_occupancy", {})
    compiled = type("Compiled", (), {"n_regs": 142, "metadata": type("Meta", (), {"shared": 71680, "num_warps": 4})})
    paged_decode.record_occupancy(("key",), compiled, torch.device("cuda"))
    paged_decode.record_occupancy(("interpreted",), None, torch.device("cuda"))
    assert paged_decode._occupancy == {("key",): 3}
