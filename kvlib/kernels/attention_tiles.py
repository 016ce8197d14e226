"""What the decode and prefill kernels share: launch settings by dtype, and one step over a K/V tile.

Both kernels walk a sequence's context in tiles of ``BLOCK_N`` positions, reading K and V
through the block table, and fold each tile into a running softmax. ``load_block_ids`` and
``attend_tile`` are that walk's two halves, so the kernels differ only in which query rows they
hold and which positions those rows may see.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels take exp2, so the launchers scale by log2(e)
MIN_DOT = 16  # smallest dimension tl.dot accepts
HOPPER = (9, 0)
NO_WINDOW = 2**31 - 1  # a sliding window longer than any context: plain causal attention


@dataclass(frozen=True)
class KernelConfig:
    """Launch settings for one dtype, chosen so ptxas reports no spills on sm_80, sm_89 and sm_90
    (``tests/test_kernel_compile.py`` compiles every variant for both and checks).

    fp32 dots must ask for IEEE precision, as the default, TF32, keeps only a 10-bit mantissa;
    they then run on CUDA cores with register-held tiles, which need more warps and, in prefill,
    shorter tiles to fit.

    On Hopper (compute capability 9.0) the 16-bit prefill tiles are the fastest of five timed on an
    H200 (``kvlib bench kernels``' ``prefill_bench``, 2026-12-04, head dim 128, 32 query heads over 8):
    128 query rows by 32 context tokens on 4 warps ran chunked prefill at 280 and 257 TFLOP/s (4 x
    2,048 behind 6,144 cached; 8,192 fresh), where 64 by 64 on 8 warps ran 147 and 145 (torch SDPA's
    flash path: 340, 320). Compiled for sm_80 and sm_89 that tile spills (255 registers), so there,
    unmeasured, the 64 by 64 tile on 8 warps stays.
    """

    dot_precision: str | None
    decode_num_warps: int
    prefill_block_m: int
    prefill_block_n: int
    prefill_num_warps: int


def kernel_config(dtype: torch.dtype, capability: tuple[int, int] | None = None) -> KernelConfig:
    """The launch settings for ``dtype`` on a GPU of compute ``capability`` (None: not a GPU)."""
    if dtype == torch.float32:
        return KernelConfig(dot_precision="ieee", decode_num_warps=8, prefill_block_m=64, prefill_block_n=16,
                            prefill_num_warps=8)
    if capability is not None and capability >= HOPPER:
        return KernelConfig(dot_precision=None, decode_num_warps=4, prefill_block_m=128, prefill_block_n=32,
                            prefill_num_warps=4)
    return KernelConfig(dot_precision=None, decode_num_warps=4, prefill_block_m=64, prefill_block_n=64,
                        prefill_num_warps=8)


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of ``device``, None off CUDA (read once per device: prefill asks every layer)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def kernel_window(sliding_window: int | None) -> int:
    """The window as the kernels take it: every launch passes one, ``NO_WINDOW`` for full causal attention."""
    if sliding_window is None:
        return NO_WINDOW
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be None or at least 1, got {sliding_window}")
    return sliding_window


def output_for(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where a launcher writes attention of ``query``: ``out`` (a view of a larger output, any strides) when given,
    else a new tensor. A step with decodes and prefills writes both kernels' rows in place this way, instead of
    copying each result into the step's output."""
    if out is None:
        return torch.empty_like(query)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must match the query's shape, dtype and device {tuple(query.shape)}, {query.dtype}, "
                         f"{query.device}; got {tuple(out.shape)}, {out.dtype}, {out.device}")
    return out


@triton.jit
def load_block_ids(table_ptr, pos, end, stride_btb, BLOCK_SIZE: tl.constexpr):
    """The block of each position ``pos < end`` (int64, so ``block x stride`` cannot overflow), 0 past ``end``."""
    return tl.load(table_ptr + (pos // BLOCK_SIZE) * stride_btb, mask=pos < end, other=0).to(tl.int64)


@triton.jit
def attend_tile(q, m, l, acc, k_ptrs, v_ptrs, kv_mask, visible, qk_scale, DOT_PRECISION: tl.constexpr):
    """Fold one tile of K/V into the running softmax ``(m, l, acc)`` of the query rows ``q``.

    ``visible[row, position]`` says which scores count. A row that sees nothing in this tile (a
    window can start past it) keeps ``m = -inf``; the scores are then measured against 0, not
    -inf, so ``alpha`` and ``p`` come out 0 rather than NaN.
    """
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


# How this copy of the kernels was built: under Triton's interpreter (CPU tensors) or compiled (GPU tensors).
INTERPRETED = type(attend_tile).__name__ == "InterpretedFunction"


def interpreter_blocker(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run these kernels beside this NumPy, or None. Before Triton 3.7 the
    interpreter turns a loaded scalar into a loop bound with ``int()`` of a one-element array, which NumPy
    refuses from 2.4 on: every decode and prefill launch would fail deep inside Triton."""
    def major_minor(version: str) -> tuple[int, int]:
        return tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups())
    if major_minor(triton_version) >= (3, 7) or major_minor(numpy_version) < (2, 4):
        return None
    return (f"Triton {triton_version}'s interpreter, which runs kvlib's kernels on CPU tensors, fails with NumPy "
            f"{numpy_version} (it calls int() on one-element arrays, which NumPy refuses since 2.4): "
            "pip install 'numpy<2.4' (or Triton 3.7 or later where your torch allows), or use "
            "attention_backend='torch'")


if INTERPRETED and (_blocker := interpreter_blocker(triton.__version__, numpy.__version__)):
    raise ImportError(_blocker)
