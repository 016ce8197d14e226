"""The CPU decode step against this machine's own matmul rate: how much of the roofline a whole step reaches.

The roofline is the fp32 rate of the matmul a decode step is mostly made of, measured here:
``[32, 576] x [576, 1536]`` (SmolLM2-135M's MLP at 32 sequences), one thread, the same operands
again and again, so it runs from cache at the best rate this CPU reaches; the weights are packed for
oneDNN as an engine's are (``kvlib.model.packed_linear``), in the model and in this matmul alike. The decode step is the
engine's own: ``ModelRunner.forward`` and ``ModelRunner.sample`` for 32 sequences of 280-320 tokens
of a random model with SmolLM2-135M's shape, so it includes packing the inputs, attention, the
language-model head and sampling. Its FLOPs are counted from the shapes: every projection, the
language-model head for each sampled row, and attention's two products over each context.

``step_anatomy`` splits the same step at several batch sizes: the projections and the head called alone
in a loop (the model's own modules, random rows), the step with each of them swapped for a stand-in that
returns zeros at no cost (``ZeroProjection``: what the norms, RoPE, the K/V store, attention, residuals
and sampling cost by themselves), and the rest: what the whole step costs beyond those two, the price of
running them together (caches one part fills and the other then misses), about nothing at small batches.
Beside them, the step's own roofline: the longer of reading what it must read (every weight once, the K/V of
every context) at this machine's memory rate (``memory_gbps``) and doing its FLOPs at the matmul rate above.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from kvlib.config import SamplingParams
from kvlib.model.config import ModelConfig
from kvlib.model.packed_linear import PackedLinear, packing_available
from kvlib.model.weight_formats import layer_projection_places, use_weight_format

MATMUL_SHAPE = (32, 576, 1536)  # (rows, inner, columns)
MEMORY_PROBE_BYTES = 512 << 20  # read to measure memory bandwidth: many times any cache


def seconds(fn) -> float:
    """One call of ``fn``, timed."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_seconds(fn, repeats: int, inner: int = 1) -> float:
    """Fastest of ``repeats`` timings of ``inner`` calls, per call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return min(times)


def matmul_gflops(shape: tuple[int, int, int] = MATMUL_SHAPE, repeats: int = 20) -> float:
    rows, inner, cols = shape
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, inner, generator=gen), torch.randn(cols, inner, generator=gen)
    linear = PackedLinear(w, None) if packing_available(x.device, x.dtype) else lambda rows: F.linear(rows, w)
    return 2 * rows * inner * cols / best_seconds(lambda: linear(x), repeats, inner=20) / 1e9


def memory_gbps(nbytes: int = MEMORY_PROBE_BYTES, repeats: int = 5) -> float:
    """The rate one thread reads memory here: the best ``sum`` over ``nbytes`` of float32, far beyond the caches."""
    x = torch.ones(nbytes // 4)
    return nbytes / best_seconds(lambda: x.sum(), repeats) / 1e9


def decode_step_flops(config: ModelConfig, context_lens: list[int]) -> float:
    """Multiply-adds times two of one decode step: one new token per sequence, every row sampled."""
    hidden, d = config.hidden_size, config.head_dim
    projections = hidden * (config.num_heads + 2 * config.num_kv_heads) * d + config.num_heads * d * hidden
    mlp = 3 * hidden * config.intermediate_size
    per_token = config.num_layers * (projections + mlp) + hidden * config.vocab_size
    attention = config.num_layers * 2 * config.num_heads * d * sum(context_lens)  # q.k and p.v, each position once
    return 2 * (per_token * len(context_lens) + attention)


def random_decode_model(shape: dict, batch: int, contexts: tuple[int, int], block_size: int, seed: int):
    """A random model of ``shape`` and ``batch`` context lengths drawn from ``contexts``:
    ``(config, model, context_lens, blocks needed per sequence, the generator for what follows)``."""
    from kvlib.model.llama import LlamaForCausalLM

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    config = ModelConfig(**shape)
    model = use_weight_format(LlamaForCausalLM(config).eval(), "float32")  # packed, as an engine's on a CPU
    context_lens = torch.randint(contexts[0], contexts[1] + 1, (batch,), generator=gen).tolist()
    return config, model, context_lens, [-(-n // block_size) for n in context_lens], gen


def decode_plan(shape: dict, batch: int, contexts: tuple[int, int], block_size: int = 16, seed: int = 0):
    """A runner over a random model of ``shape`` and a decode plan of ``batch`` sequences: ``(runner, plan)``."""
    from kvlib.attention.torch_backend import TorchAttentionBackend
    from kvlib.core.plan import SchedulerOutput
    from kvlib.core.sequence import Sequence
    from kvlib.runner.model_runner import ModelRunner

    config, model, context_lens, needed, gen = random_decode_model(shape, batch, contexts, block_size, seed)
    runner = ModelRunner(model, TorchAttentionBackend(), block_size=block_size, num_gpu_blocks=sum(needed),
                         num_cpu_blocks=0, device=torch.device("cpu"), dtype=torch.float32, max_num_seqs=batch,
                         max_model_len=contexts[1])
    runner.device_pool.data.normal_(generator=gen)
    ids = torch.randperm(sum(needed), generator=gen).tolist()
    plan = SchedulerOutput()
    for i, (length, count) in enumerate(zip(context_lens, needed)):
        prompt = torch.randint(0, config.vocab_size, (length,), generator=gen).tolist()
        seq = Sequence(str(i), prompt, SamplingParams(), block_size, 0.0)
        seq.block_table.blocks, ids = ids[:count], ids[count:]
        seq.num_computed_tokens = length - 1
        plan.add(seq, 1)
    return runner, plan, context_lens


def run_roofline(shape: dict, batch: int, contexts: tuple[int, int], steps: int = 8) -> list[dict]:
    """One row: the matmul rate, and the decode step's time and FLOP rate (best and median of ``steps``)."""
    runner, plan, context_lens = decode_plan(shape, batch, contexts)

    def step():
        runner.sample(runner.forward(plan), plan)

    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = matmul_gflops()
    flops = decode_step_flops(runner.model.config, context_lens)
    best, median = min(times), statistics.median(times)
    return [{"matmul GFLOPS (32x576x1536)": peak, "decode step GFLOP": flops / 1e9, "step ms, best": 1e3 * best,
             "step ms, median": 1e3 * median, "step GFLOPS, best": flops / best / 1e9,
             "% of matmul rate, best": 100 * flops / best / 1e9 / peak,
             "% of matmul rate, median": 100 * flops / median / 1e9 / peak}]


class ZeroProjection(nn.Module):
    """A projection's stand-in that returns zeros of its output's shape: the step around it, at no matmul's cost."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(x.shape[0], self.out_features)


def projections(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every layer projection and the language-model head, as ``(owner, attribute)`` in the order a step calls them."""
    return [(owner, attr) for _, _, owner, attr in layer_projection_places(model)] + [(model, "lm_head")]


def decode_step_bytes(model: nn.Module, context_lens: list[int], kv_bytes_per_token: int) -> int:
    """What one decode step must read from memory: every projection's and the head's weights once, as the
    model holds them, and the K and V of every context position (``KVCacheSpec.bytes_per_token`` each)."""
    weights = sum(tensor.numel() * tensor.element_size() for owner, attr in projections(model)
                  for tensor in getattr(owner, attr).state_dict().values())
    return weights + kv_bytes_per_token * sum(context_lens)


@contextmanager
def zero_projections(model: nn.Module):
    """``model`` with every projection and its head swapped for ``ZeroProjection``, put back on leaving."""
    places = projections(model)
    real = [getattr(owner, attr) for owner, attr in places]
    for (owner, attr), module in zip(places, real):
        setattr(owner, attr, ZeroProjection(module.out_features))
    try:
        yield
    finally:
        for (owner, attr), module in zip(places, real):
            setattr(owner, attr, module)


def step_anatomy(shape: dict, batches: tuple[int, ...], contexts: tuple[int, int], steps: int = 8,
                 gbps: float | None = None, gflops: float | None = None) -> list[dict]:
    """Per batch size, the best of ``steps`` rounds, each timing in turn the whole decode step, its projections
    and head alone, and the step with them swapped for ``ZeroProjection``; the rest is the whole step less the
    other two. The roofline is the longer of reading the step's bytes at ``gbps`` and doing its FLOPs at
    ``gflops`` (this machine's ``memory_gbps`` and ``matmul_gflops`` where not given)."""
    gbps, gflops = gbps or memory_gbps(), gflops or matmul_gflops()
    rows = []
    for batch in batches:
        runner, plan, context_lens = decode_plan(shape, batch, contexts)
        calls = [(module, torch.randn(batch, module.in_features))
                 for module in (getattr(owner, attr) for owner, attr in projections(runner.model))]

        def whole_step():
            runner.sample(runner.forward(plan), plan)

        def projections_alone():
            with torch.inference_mode():
                for module, x in calls:
                    module(x)

        times: dict[str, list[float]] = {}
        for round_ in range(steps + 1):  # the first round warms up and is not counted
            timed = {"step ms": seconds(whole_step), "projections and head alone ms": seconds(projections_alone)}
            with zero_projections(runner.model):
                timed["step without them ms"] = seconds(whole_step)
            if round_:
                for name, took in timed.items():
                    times.setdefault(name, []).append(took)
        row = {"batch": batch, **{name: 1e3 * min(t) for name, t in times.items()}}
        row["rest ms"] = row["step ms"] - row["projections and head alone ms"] - row["step without them ms"]
        reads = decode_step_bytes(runner.model, context_lens, runner.device_pool.spec.bytes_per_token)
        roofline = max(reads / gbps / 1e9, decode_step_flops(runner.model.config, context_lens) / gflops / 1e9)
        row.update({"roofline ms": 1e3 * roofline, "step / roofline": row["step ms"] / (1e3 * roofline)})
        rows.append(row)
    return rows
