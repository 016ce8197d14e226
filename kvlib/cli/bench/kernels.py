"""``kvlib bench kernels``: how close the paged decode kernel gets to the memory roofline.

Decode reads every cached K/V byte once per step and does little arithmetic on it, so its speed
is a bandwidth question. For each shape (batch x context: 1 x 32k, 32 x 4k, 256 x 1k; 32 query
heads over 8 kv heads, head dim 128, blocks of 16 tokens in shuffled order), in the dtype the engine
serves this GPU in (bfloat16 from compute capability 8.0) and then in float16 (``bench_dtypes``), it
reports:

- the K/V bytes read per microsecond, as GB/s and as a share of the device's peak bandwidth;
- the same attention through ``torch.nn.functional.scaled_dot_product_attention`` over a
  contiguous cache ``[batch, kv_heads, context, head_dim]``: the speed paging is measured
  against. Each kv head's query group is passed as that head's query rows (decode has no causal
  mask), so SDPA also reads every K/V byte once, with no repeated kv heads.
- at 1 x 32k, the kernel both plain and with split-KV, the case the split exists for.

Peak bandwidth comes from ``PEAK_BANDWIDTH_GBPS``, vendor figures matched against the device
name. A device not in it gets no "% of peak" figure rather than a guessed one: add its entry.
Every shape reads far more K/V than any L2 cache holds, and ``triton.testing.do_bench`` clears
the L2 between runs anyway. A GPU below compute capability 8.0 (a T4) is refused: the kernels
target 8.0+, the engine serves such a GPU with the torch backend, and figures measured there
would describe neither.

Without CUDA it measures what serves a CPU instead, the torch backend: decode steps of a
random model with SmolLM2-135M's shape (``SMOLLM2_SHAPE``; 30 layers, 9 query heads over 3 kv
heads, head dim 64) for 32 sequences of 280 to 320 tokens in shuffled blocks of 16, in float32.
It reports the milliseconds per step spent in attention and in the whole forward, for
``TorchAttentionBackend`` and, side by side, for a backend running ``paged_attention_reference``,
then the engine's whole decode step (``ModelRunner.forward`` and ``sample``) against this machine's
own matmul rate (:mod:`kvlib.cli.bench.roofline`), and what that step is made of at 1, 8 and 32
sequences (``step_anatomy``: the projections alone, the rest alone, the roofline). Run it with ``OMP_NUM_THREADS=1``
for figures that do not depend on the machine's core count.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from kvlib.attention.metadata import AttentionMetadata
from kvlib.attention.torch_backend import TorchAttentionBackend, paged_attention_reference
from kvlib.cli.bench.peers import PeersOptions

SHAPES = [(1, 32768), (32, 4096), (256, 1024)]  # (batch, context)
SPLIT_SHAPE = (1, 32768)
NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
SECOND_DTYPE = torch.float16  # timed after the engine's own dtype, where that is another

# Vendor peak memory bandwidth, GB/s. Matched in order as substrings of the upper-cased device name,
# so the more specific names come first ("A100" before "A10", "L40" before "L4").
PEAK_BANDWIDTH_GBPS = [
    ("H200", 4800),
    ("H100 NVL", 3900),
    ("H100 PCIE", 2000),
    ("H100", 3350),  # SXM, named "H100 80GB HBM3"
    ("A100-SXM4-80GB", 2039),
    ("A100 80GB PCIE", 1935),
    ("A100", 1555),  # the 40 GB parts
    ("L40", 864),  # L40 and L40S
    ("L4", 300),
    ("A10", 600),  # A10 and A10G
    ("T4", 320),
]


def peak_bandwidth_gbps(device_name: str) -> float | None:
    """The table's peak for this device, or None for a device it does not list."""
    name = device_name.upper()
    return next((float(peak) for key, peak in PEAK_BANDWIDTH_GBPS if key in name), None)


def bench_dtypes(engine_dtype: torch.dtype) -> list[torch.dtype]:
    """The dtypes timed, first the one the engine serves in (what its decode steps run), then float16."""
    return list(dict.fromkeys([engine_dtype, SECOND_DTYPE]))


def decode_case(batch: int, context: int, device: torch.device | str,
                dtype: torch.dtype) -> tuple[Callable, Callable, int]:
    """The paged kernel (a function of the split count), its SDPA twin, and the K/V bytes both read."""
    from kvlib.kernels import paged_decode_attention

    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    pool = torch.randn(num_blocks, 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    scale = HEAD_DIM ** -0.5

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        tokens = cache[block_tables.long()].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context]
        return tokens.transpose(1, 2).contiguous()

    k, v = contiguous(k_cache), contiguous(v_cache)
    grouped_query = query.view(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)

    def paged(num_splits: int | None) -> torch.Tensor:
        return paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                                      max_context_len=context, num_splits=num_splits)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(grouped_query, k, v, scale=scale).reshape(batch, NUM_HEADS, HEAD_DIM)

    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * pool.element_size()
    return paged, sdpa, kv_bytes


def below_kernel_capability(device: torch.device | str = "cuda") -> str | None:
    """Why this GPU is refused (compute capability below 8.0), or None when the kernels target it."""
    from kvlib.runner.device import MIN_TRITON_CAPABILITY
    capability = torch.cuda.get_device_capability(device)
    if capability >= MIN_TRITON_CAPABILITY:
        return None
    need = ".".join(map(str, MIN_TRITON_CAPABILITY))
    return (f"{torch.cuda.get_device_name(device)} has compute capability {'.'.join(map(str, capability))}; "
            f"kvlib's Triton kernels target {need}+ and the engine runs the torch backend on it, "
            f"so there is no kernel to measure here")


def run_kernel_bench(dtypes: list[torch.dtype] | None = None) -> list[dict]:
    """One row per (dtype, shape, implementation); empty where there is no CUDA device. ``dtypes``: those timed
    (``bench_dtypes`` of the engine's when None).

    Raises RuntimeError on a GPU below compute capability 8.0.
    """
    if not torch.cuda.is_available():
        return []
    refused = below_kernel_capability()
    if refused:
        raise RuntimeError(refused)
    from triton.testing import do_bench

    from kvlib.kernels import choose_num_splits
    from kvlib.runner.device import resolve_dtype

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = peak_bandwidth_gbps(name)
    peak_column = f"% of peak ({peak:,.0f} GB/s)" if peak else "% of peak (device not in table)"
    rows: list[dict] = []

    def row(dtype: torch.dtype, shape: str, kernel: str, splits: int | None, ms: float, kv_bytes: int,
            sdpa_ms: float) -> dict:
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        return {"device": name if not rows else None, "dtype": str(dtype).removeprefix("torch."),
                "batch x context": shape, "kernel": kernel, "splits": splits,
                "time (us)": ms * 1e3, "K/V GB/s": gbps, peak_column: 100 * gbps / peak if peak else None,
                "speedup vs sdpa": sdpa_ms / ms}

    for dtype in dtypes or bench_dtypes(resolve_dtype("auto", device)):
        for batch, context in SHAPES:
            paged, sdpa, kv_bytes = decode_case(batch, context, device, dtype)
            shape = f"{batch} x {context:,}"
            sdpa_ms = do_bench(sdpa, return_mode="median")
            auto = choose_num_splits(batch, NUM_KV_HEADS, context, device)
            if (batch, context) == SPLIT_SHAPE:
                variants = [("triton paged, plain", 1), ("triton paged, split-KV", max(2, auto))]
            else:
                variants = [("triton paged", auto)]
            for kernel, splits in variants:
                ms = do_bench(lambda: paged(splits), return_mode="median")
                rows.append(row(dtype, shape, kernel, splits, ms, kv_bytes, sdpa_ms))
            rows.append(row(dtype, shape, "torch sdpa, contiguous", None, sdpa_ms, kv_bytes, sdpa_ms))
            del paged, sdpa
            torch.cuda.empty_cache()
    return rows


SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                     num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)
CPU_BATCH = 32
CPU_CONTEXTS = (280, 320)  # each sequence's context length is drawn from this range
ANATOMY_BATCHES = PeersOptions.batches  # the batch sizes kvlib bench peers compares engines at


class TimedBackend:
    """Wraps a backend and adds up the seconds its ``forward`` (attention) takes."""

    def __init__(self, backend, name: str):
        self.backend, self.name, self.seconds = backend, name, 0.0

    def store_kv(self, *args) -> None:
        self.backend.store_kv(*args)

    def forward(self, *args) -> torch.Tensor:
        start = time.perf_counter()
        out = self.backend.forward(*args)
        self.seconds += time.perf_counter() - start
        return out


class ReferenceBackend(TorchAttentionBackend):
    """The torch backend with ``paged_attention_reference`` for every step: the baseline."""

    def forward(self, query, k_cache, v_cache, meta, scale):
        return paged_attention_reference(query, k_cache, v_cache, meta, scale)


def torch_decode_case(shape: dict, batch: int, contexts: tuple[int, int], block_size: int = 16, seed: int = 0):
    """A random model, a pool of random K/V and one decode step's inputs: ``(model, pool, inputs)``."""
    from kvlib.cli.bench.roofline import random_decode_model
    from kvlib.runner.kv_cache import KVCachePool, KVCacheSpec

    config, model, context_lens, needed, gen = random_decode_model(shape, batch, contexts, block_size, seed)
    pool = KVCachePool(KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, block_size,
                                   torch.float32), sum(needed), "cpu")
    pool.data.normal_(generator=gen)
    ids = torch.randperm(sum(needed), generator=gen).tolist()
    tables = torch.zeros(batch, max(needed), dtype=torch.int32)
    for i, count in enumerate(needed):
        tables[i, :count] = torch.tensor(ids[:count])
        ids = ids[count:]
    last = [n - 1 for n in context_lens]
    slots = [int(tables[i, p // block_size]) * block_size + p % block_size for i, p in enumerate(last)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=tables,
                             context_lens=torch.tensor(context_lens, dtype=torch.int32),
                             query_start=torch.arange(batch + 1, dtype=torch.int32), max_query_len=1,
                             max_context_len=max(context_lens))
    inputs = (torch.randint(0, config.vocab_size, (batch,), generator=gen), torch.tensor(last), meta,
              torch.arange(batch))
    return model, pool, inputs


def run_torch_decode_bench(shape: dict = SMOLLM2_SHAPE, batch: int = CPU_BATCH,
                           contexts: tuple[int, int] = CPU_CONTEXTS, steps: int = 8) -> list[dict]:
    """Median ms per decode step, attention and whole forward, per backend; both run in turns, side by side."""
    model, pool, (token_ids, positions, meta, rows) = torch_decode_case(shape, batch, contexts)
    backends = [TimedBackend(TorchAttentionBackend(), "torch backend"),
                TimedBackend(ReferenceBackend(), "paged_attention_reference")]
    times: dict[str, list[tuple[float, float]]] = {b.name: [] for b in backends}
    for step in range(steps + 1):  # the first round warms up and is not counted
        for backend in backends:
            backend.seconds = 0.0
            start = time.perf_counter()
            model(token_ids, positions, pool, meta, backend, rows)
            if step:
                times[backend.name].append((backend.seconds, time.perf_counter() - start))
    return [{"attention": name, "attention ms/step": 1e3 * statistics.median(a for a, _ in runs),
             "forward ms/step": 1e3 * statistics.median(f for _, f in runs),
             "attention share %": 100 * statistics.median(a / f for a, f in runs)} for name, runs in times.items()]


def build_parser():
    """``kvlib bench kernels`` takes no options: it times what the machine has."""
    import argparse
    return argparse.ArgumentParser(prog="kvlib bench kernels", description=__doc__.splitlines()[0])


def main(argv: list[str] | None = None) -> int:
    from kvlib.cli.bench.report import format_table
    build_parser().parse_args(argv)
    refused = torch.cuda.is_available() and below_kernel_capability()
    if refused:
        print(f"kvlib bench kernels: {refused}")
        return 1
    rows = run_kernel_bench()
    if not rows:
        print("kvlib bench kernels: no CUDA GPU here, so no kernel to time (their correctness is tested on the "
              "CPU under the Triton interpreter: pytest tests/test_kernels.py); timing the torch backend instead")
        title = (f"torch backend decode, SmolLM2-135M's shape with random weights, {CPU_BATCH} sequences of "
                 f"{CPU_CONTEXTS[0]}-{CPU_CONTEXTS[1]} tokens, blocks of 16, float32, {torch.get_num_threads()} "
                 f"thread(s)")
        print(format_table(run_torch_decode_bench(), title))
        from kvlib.cli.bench.roofline import run_roofline
        print()
        roofline = run_roofline(SMOLLM2_SHAPE, CPU_BATCH, CPU_CONTEXTS)
        print(format_table(roofline,
                           "the engine's decode step (forward and sampling) against this machine's matmul rate"))
        from kvlib.cli.bench.roofline import step_anatomy
        print()
        print(format_table(step_anatomy(SMOLLM2_SHAPE, ANATOMY_BATCHES, CPU_CONTEXTS,
                                        gflops=roofline[0]["matmul GFLOPS (32x576x1536)"]),
                           "the same step split (best of 8): its projections and head alone, the step with them "
                           "returning zeros at no cost, the rest, and the step against its roofline (its bytes at "
                           "this machine's memory rate, its FLOPs at the matmul rate)"))
        return 0
    print(format_table(rows, f"paged decode attention on {torch.cuda.get_device_name()}"))
    return 0
