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

Two measuring functions go further, for a GPU check to call (each returns plain rows, empty without CUDA):

- ``decode_sweep``: the decode kernel over a small grid of split counts and launch tunings (BLOCK_N,
  warps, pipeline stages), each timed eagerly and replayed from a CUDA graph (what the engine's decode
  replays see: no Python launch cost), against SDPA timed both ways;
- ``prefill_bench``: chunked-prefill attention in TFLOP/s over the causally visible pairs, per launch
  tuning, against SDPA's fused causal kernels, naming the path SDPA took.

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
from functools import partial
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


def decode_kv_bytes(batch: int, context: int, dtype: torch.dtype) -> int:
    """K/V bytes one decode call reads: every cached token's K and V of every kv head."""
    return 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()


def decode_case(batch: int, context: int, device: torch.device | str,
                dtype: torch.dtype, layers: int = 1) -> tuple[Callable, Callable, int]:
    """The paged kernel (a function of the split count, the layer, the context bound it is told (a CUDA graph's
    bucket bound) and the kernel's tunables), its SDPA twin (a
    function of the layer), and the K/V bytes either reads per call. ``layers``: how many layers the pool holds,
    so calls back to back can read different bytes, as a model's layers do."""
    from kvlib.kernels import paged_decode_attention

    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    pool = torch.randn(num_blocks, layers, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    scale = HEAD_DIM ** -0.5

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        tokens = cache[block_tables.long()].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context]
        return tokens.transpose(1, 2).contiguous()

    contiguous_kv = [(contiguous(pool[:, layer, 0]), contiguous(pool[:, layer, 1])) for layer in range(layers)]
    grouped_query = query.view(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)

    def paged(num_splits: int | None, layer: int = 0, max_context_len: int = context, **tunables) -> torch.Tensor:
        return paged_decode_attention(query, pool[:, layer, 0], pool[:, layer, 1], block_tables, context_lens, scale,
                                      max_context_len=max_context_len, num_splits=num_splits, **tunables)

    def sdpa(layer: int = 0) -> torch.Tensor:
        k, v = contiguous_kv[layer]
        return F.scaled_dot_product_attention(grouped_query, k, v, scale=scale).reshape(batch, NUM_HEADS, HEAD_DIM)

    return paged, sdpa, decode_kv_bytes(batch, context, dtype)


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
                ms = do_bench(partial(paged, splits), return_mode="median")
                rows.append(row(dtype, shape, kernel, splits, ms, kv_bytes, sdpa_ms))
            rows.append(row(dtype, shape, "torch sdpa, contiguous", None, sdpa_ms, kv_bytes, sdpa_ms))
            del paged, sdpa
            torch.cuda.empty_cache()
    return rows


# decode_sweep: the kernel's tunables over the timed shapes, each timed eagerly and replayed from a CUDA graph.
DecodeTuning = tuple[int, int, int]  # (BLOCK_N, num_warps, num_stages)
DEFAULT_DECODE_TUNING: DecodeTuning = (64, 4, 3)  # paged_decode.BLOCK_N, bf16's decode_num_warps, Triton's default
DECODE_TUNINGS: list[DecodeTuning] = [DEFAULT_DECODE_TUNING, (32, 4, 3), (128, 4, 3), (64, 8, 3), (128, 8, 3),
                                      (64, 4, 2), (64, 4, 4), (32, 4, 4)]
# Forced split counts tried at 1 x 32k, per kv head. On the H200 (2026-12-04) 32 splits (256 programs, under two per
# multiprocessor) beat the rule's 49 (three per multiprocessor), 64.6% against 59.2% of peak: the counts around 32
# say whether the rule should aim at fewer programs per multiprocessor.
SWEEP_SPLITS = (16, 24, 32, 40, 64, 128, 256)
TUNED_SPLITS = 32  # the split count every tuning is tried at, at 1 x 32k: the best count the H200 measured
SHORT_SPLITS = (2, 4)  # forced split counts tried at the batched shapes, default tuning
GRAPH_BYTES = 512 * 2**20  # K/V a graph replay reads at least, over distinct layers, so no call is served from L2
MAX_GRAPH_LAYERS = 8
BENCH_WARMUP_MS, BENCH_REP_MS = 10, 50  # do_bench's budget per timing: enough at tens of microseconds a call


def graph_layers(kv_bytes: int) -> int:
    """Layers one graph replay walks, each call reading its own layer's K/V: ``GRAPH_BYTES`` in all, or more."""
    return max(1, min(MAX_GRAPH_LAYERS, -(-GRAPH_BYTES // kv_bytes)))


def eager_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of one call launched from Python (do_bench: L2 cleared before each)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS, return_mode="median")


def graph_ms(calls: list[Callable[[], object]]) -> float:
    """Median milliseconds per call of ``calls`` captured back to back in one CUDA graph and replayed, as the
    engine replays decode: no Python launch cost, no allocation. The calls run once on a side stream first
    (compiling, warming the allocator), outside the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    ms = eager_ms(graph.replay) / len(calls)
    del graph
    return ms


def tuning_label(splits: int, tuning: DecodeTuning) -> str:
    block_n, warps, stages = tuning
    return f"{'plain' if splits == 1 else f'split {splits}'}, BLOCK_N {block_n}, {warps} warps, {stages} stages"


def decode_variants(batch: int, context: int, auto_splits: int) -> list[tuple[int, DecodeTuning]]:
    """``(splits, tuning)`` pairs tried at one shape. At 1 x 32k: plain, the rule's count and ``SWEEP_SPLITS`` at
    the default tuning, then every tuning at ``TUNED_SPLITS``; elsewhere every tuning at the rule's count and
    ``SHORT_SPLITS`` at the default. Few distinct compiles: a split count is a kernel argument, not a constant
    (only the merge kernel compiles once per power of two)."""
    if batch == 1:
        pairs = [(1, DEFAULT_DECODE_TUNING), (auto_splits, DEFAULT_DECODE_TUNING)]
        pairs += [(splits, DEFAULT_DECODE_TUNING) for splits in SWEEP_SPLITS]
        pairs += [(TUNED_SPLITS, tuning) for tuning in DECODE_TUNINGS]
    else:
        pairs = [(auto_splits, tuning) for tuning in DECODE_TUNINGS]
        pairs += [(splits, DEFAULT_DECODE_TUNING) for splits in SHORT_SPLITS]
    return list(dict.fromkeys(pairs))


def decode_sweep(shapes: list[tuple[int, int]] = SHAPES, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Paged decode over a grid of split counts and launch tunings (``decode_variants``), each timed eagerly and
    replayed from a CUDA graph, against SDPA over a contiguous cache timed both ways: one row per (shape,
    variant). Empty without CUDA; about 22 compiles at the default shapes.

    The eager figure is what a Python loop of launches sees (at 1 x 32k, 28 us of K/V at an H200's peak, the
    launches themselves can dominate); the graph figure is what the engine's decode replays see, and the one
    to compare with the bandwidth roofline."""
    if not torch.cuda.is_available():
        return []
    from kvlib.kernels import choose_num_splits
    device = torch.device("cuda")
    peak = peak_bandwidth_gbps(torch.cuda.get_device_name(device))
    rows = []
    for batch, context in shapes:
        layers = graph_layers(decode_kv_bytes(batch, context, dtype))
        paged, sdpa, kv_bytes = decode_case(batch, context, device, dtype, layers)
        sdpa_eager = eager_ms(sdpa)
        sdpa_graph = graph_ms([partial(sdpa, layer) for layer in range(layers)])
        shape = f"{batch} x {context:,}"
        rows.append(sweep_row(shape, "torch sdpa, contiguous", None, None, sdpa_eager, sdpa_graph, kv_bytes, peak,
                              sdpa_eager, sdpa_graph, layers))
        auto = choose_num_splits(batch, NUM_KV_HEADS, context, device)
        for splits, tuning in decode_variants(batch, context, auto):
            block_n, warps, stages = tuning
            call = partial(paged, splits, block_n=block_n, num_warps=warps, num_stages=stages)  # call(layer)
            label = tuning_label(splits, tuning) + (" (the rule's count)" if splits == auto else "")
            try:
                kernel_eager = eager_ms(call)
                kernel_graph = graph_ms([partial(call, layer) for layer in range(layers)])
            except Exception as error:  # noqa: BLE001 - a tuning the device cannot run (shared memory) is a finding
                rows.append({"shape": shape, "variant": label, "error": f"{type(error).__name__}: {error}"[:300]})
                continue
            rows.append(sweep_row(shape, label, splits, tuning, kernel_eager, kernel_graph, kv_bytes, peak,
                                  sdpa_eager, sdpa_graph, layers))
        del paged, sdpa
        torch.cuda.empty_cache()
    return rows


def sweep_row(shape: str, variant: str, splits: int | None, tuning: DecodeTuning | None, eager: float,
              graph: float, kv_bytes: int, peak: float | None, sdpa_eager: float, sdpa_graph: float,
              layers: int) -> dict:
    """One row of ``decode_sweep``: times in microseconds, bandwidth, share of peak and speed against SDPA
    timed the same way (above 1: faster than SDPA)."""
    row = {"shape": shape, "variant": variant, "splits": splits, "block_n": tuning and tuning[0],
           "num_warps": tuning and tuning[1], "num_stages": tuning and tuning[2], "graph layers": layers}
    for timing, ms, sdpa_ms in (("eager", eager, sdpa_eager), ("graph", graph, sdpa_graph)):
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        row |= {f"{timing} us": ms * 1e3, f"{timing} GB/s": gbps,
                f"{timing} % of peak": 100 * gbps / peak if peak else None, f"{timing} x sdpa": sdpa_ms / ms}
    return row


# prefill_bench: chunked-prefill attention against SDPA's fused kernels, compute-bound, in TFLOP/s.
PREFILL_CASES = [(4, 2048, 8192), (1, 8192, 8192)]  # (sequences, query tokens each, context each)
PrefillTuning = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
DEFAULT_PREFILL_TUNING: PrefillTuning = (128, 32, 4, 3)  # bf16's kernel_config on Hopper, Triton's default stages
PREFILL_TUNINGS: list[PrefillTuning] = [DEFAULT_PREFILL_TUNING, (64, 64, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3),
                                        (128, 64, 8, 2)]


def causal_pairs(query_len: int, context_len: int) -> int:
    """(query, key) pairs a causal chunk of ``query_len`` queries at the end of ``context_len`` positions sees:
    query i (at position ``context_len - query_len + i``) sees that many keys plus one."""
    return query_len * (context_len - query_len) + query_len * (query_len + 1) // 2


def attention_flops(num_seqs: int, query_len: int, context_len: int) -> int:
    """Multiply-adds of QK^T and PV over the visible pairs, 2 FLOPs each: 4 x pairs x head dim x query heads."""
    return 4 * num_seqs * causal_pairs(query_len, context_len) * HEAD_DIM * NUM_HEADS


def prefill_case(num_seqs: int, query_len: int, context_len: int, device: torch.device | str, dtype: torch.dtype):
    """The paged prefill kernel over shuffled blocks (a function of its tunables) and the same attention's
    inputs for SDPA, ``[num_seqs, heads, tokens, head_dim]`` with K/V repeated to every query head."""
    from kvlib.kernels import paged_prefill_attention

    blocks_per_seq = -(-context_len // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    pool = torch.randn(num_blocks, 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
    block_tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq).int()
    context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device=device)
    query_start = torch.arange(0, (num_seqs + 1) * query_len, query_len, dtype=torch.int32, device=device)
    query = torch.randn(num_seqs * query_len, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    scale = HEAD_DIM ** -0.5

    def paged(**tunables) -> torch.Tensor:
        return paged_prefill_attention(query, k_cache, v_cache, block_tables, context_lens, query_start, query_len,
                                       scale, **tunables)

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        tokens = cache[block_tables.long()].reshape(num_seqs, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context_len]
        return tokens.transpose(1, 2).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1).contiguous()

    sdpa_inputs = (query.view(num_seqs, query_len, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous(),
                   contiguous(k_cache), contiguous(v_cache), scale)
    return paged, sdpa_inputs


def sdpa_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> tuple[Callable, str]:
    """SDPA causal attention of ``query`` at the end of the keys, pinned to the first fused path that accepts it
    (flash, then memory-efficient, then cuDNN; math last): the call and that path's name. A query as long as
    the keys is ``is_causal``; a chunk behind a prefix needs the causal mask aligned to the lower right
    (``causal_lower_right``), as ``is_causal`` aligns it to the upper left."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    if query.shape[2] == key.shape[2]:
        kwargs = dict(is_causal=True)
    else:
        kwargs = dict(attn_mask=causal_lower_right(query.shape[2], key.shape[2]))
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        def call(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(query, key, value, scale=scale, **kwargs)
        try:
            call()
        except RuntimeError:
            continue
        return call, backend.name.lower()
    raise RuntimeError("no SDPA backend accepts this attention")


def prefill_bench(cases: list[tuple[int, int, int]] = PREFILL_CASES, dtype: torch.dtype = torch.bfloat16,
                  tunings: list[PrefillTuning] = PREFILL_TUNINGS) -> list[dict]:
    """Chunked-prefill attention in TFLOP/s (causal FLOPs over the visible pairs only) for each tuning, against
    SDPA over a contiguous cache: one row per (case, tuning) and one for SDPA naming the path it took. Empty
    without CUDA; one compile per tuning (the cases share them)."""
    if not torch.cuda.is_available():
        return []
    device = torch.device("cuda")
    rows = []
    for num_seqs, query_len, context_len in cases:
        paged, sdpa_inputs = prefill_case(num_seqs, query_len, context_len, device, dtype)
        sdpa, path = sdpa_causal(*sdpa_inputs)
        flops = attention_flops(num_seqs, query_len, context_len)
        fresh = "fresh" if query_len == context_len else f"behind {context_len - query_len:,} cached"
        case = f"{num_seqs} x {query_len:,} {fresh}"
        sdpa_ms = eager_ms(sdpa)
        rows.append({"case": case, "implementation": f"torch sdpa ({path}), contiguous", "tuning": None,
                     "ms": sdpa_ms, "TFLOP/s": flops / sdpa_ms / 1e9, "x sdpa": 1.0})
        for block_m, block_n, warps, stages in tunings:
            tuning = f"BLOCK_M {block_m}, BLOCK_N {block_n}, {warps} warps, {stages} stages"
            try:
                ms = eager_ms(partial(paged, block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages))
            except Exception as error:  # noqa: BLE001 - a tuning the device cannot run (shared memory) is a finding
                rows.append({"case": case, "implementation": "triton paged prefill", "tuning": tuning,
                             "error": f"{type(error).__name__}: {error}"[:300]})
                continue
            rows.append({"case": case, "implementation": "triton paged prefill", "tuning": tuning,
                         "ms": ms, "TFLOP/s": flops / ms / 1e9, "x sdpa": sdpa_ms / ms})
        del paged, sdpa, sdpa_inputs
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
