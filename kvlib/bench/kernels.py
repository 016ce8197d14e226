"""``kvlib bench kernels``: how close the paged decode kernel gets to the memory roofline.

Decode reads every cached K/V byte once per step and does little arithmetic on it, so its speed
is a bandwidth question. For each shape (batch x context: 1 x 32k, 32 x 4k, 256 x 1k; 32 query
heads over 8 kv heads, head dim 128, fp16, blocks of 16 tokens in shuffled order) it reports:

- the K/V bytes read per microsecond, as GB/s and as a share of the device's peak bandwidth;
- the same attention through ``torch.nn.functional.scaled_dot_product_attention`` over a
  contiguous cache ``[batch, kv_heads, context, head_dim]``: the speed paging is measured
  against. Each kv head's query group is passed as that head's query rows (decode has no causal
  mask), so SDPA also reads every K/V byte once, with no repeated kv heads.
- at 1 x 32k, the kernel both plain and with split-KV, the case the split exists for.

Peak bandwidth comes from ``PEAK_BANDWIDTH_GBPS``, vendor figures matched against the device
name. A device not in it gets no "% of peak" figure rather than a guessed one: add its entry.
Every shape reads far more K/V than any L2 cache holds, and ``triton.testing.do_bench`` clears
the L2 between runs anyway. Without CUDA there is nothing to measure and the list is empty. A GPU
below compute capability 8.0 (a T4) is refused: the kernels target 8.0+, the engine serves such a
GPU with the torch backend, and figures measured there would describe neither.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

SHAPES = [(1, 32768), (32, 4096), (256, 1024)]  # (batch, context)
SPLIT_SHAPE = (1, 32768)
NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
DTYPE = torch.float16

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


def decode_case(batch: int, context: int, device: torch.device | str) -> tuple[Callable, Callable, int]:
    """The paged kernel (a function of the split count), its SDPA twin, and the K/V bytes both read."""
    from kvlib.kernels import paged_decode_attention

    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    pool = torch.randn(num_blocks, 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
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
    from kvlib.device import MIN_TRITON_CAPABILITY
    capability = torch.cuda.get_device_capability(device)
    if capability >= MIN_TRITON_CAPABILITY:
        return None
    need = ".".join(map(str, MIN_TRITON_CAPABILITY))
    return (f"{torch.cuda.get_device_name(device)} has compute capability {'.'.join(map(str, capability))}; "
            f"kvlib's Triton kernels target {need}+ and the engine runs the torch backend on it, "
            f"so there is no kernel to measure here")


def run_kernel_bench() -> list[dict]:
    """One row per (shape, implementation); empty where there is no CUDA device.

    Raises RuntimeError on a GPU below compute capability 8.0.
    """
    if not torch.cuda.is_available():
        return []
    refused = below_kernel_capability()
    if refused:
        raise RuntimeError(refused)
    from triton.testing import do_bench

    from kvlib.kernels import choose_num_splits

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = peak_bandwidth_gbps(name)
    peak_column = f"% of peak ({peak:,.0f} GB/s)" if peak else "% of peak (device not in table)"
    rows: list[dict] = []

    def row(shape: str, kernel: str, splits: int | None, ms: float, kv_bytes: int, sdpa_ms: float) -> dict:
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        return {"device": name if not rows else None, "batch x context": shape, "kernel": kernel, "splits": splits,
                "time (us)": ms * 1e3, "K/V GB/s": gbps, peak_column: 100 * gbps / peak if peak else None,
                "speedup vs sdpa": sdpa_ms / ms}

    for batch, context in SHAPES:
        paged, sdpa, kv_bytes = decode_case(batch, context, device)
        shape = f"{batch} x {context:,}"
        sdpa_ms = do_bench(sdpa, return_mode="median")
        auto = choose_num_splits(batch, NUM_KV_HEADS, context, device)
        if (batch, context) == SPLIT_SHAPE:
            variants = [("triton paged, plain", 1), ("triton paged, split-KV", max(2, auto))]
        else:
            variants = [("triton paged", auto)]
        for kernel, splits in variants:
            ms = do_bench(lambda: paged(splits), return_mode="median")
            rows.append(row(shape, kernel, splits, ms, kv_bytes, sdpa_ms))
        rows.append(row(shape, "torch sdpa, contiguous", None, sdpa_ms, kv_bytes, sdpa_ms))
        del paged, sdpa
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    from kvlib.bench.report import format_table
    argparse.ArgumentParser(prog="kvlib bench kernels", description=__doc__.splitlines()[0]).parse_args(argv)
    refused = torch.cuda.is_available() and below_kernel_capability()
    if refused:
        print(f"kvlib bench kernels: {refused}")
        return 1
    rows = run_kernel_bench()
    if not rows:
        print("kvlib bench kernels: no CUDA GPU here, nothing to measure (the kernels' correctness is "
              "tested on the CPU under the Triton interpreter: pytest tests/test_kernels.py)")
        return 0
    print(format_table(rows, f"paged decode attention on {torch.cuda.get_device_name()}"))
    return 0
