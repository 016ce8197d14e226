"""What the decode and prefill kernels share: launch settings by dtype, and one step over a K/V tile.

Both kernels walk a sequence's context in tiles of ``BLOCK_N`` positions, reading K and V
through the block table, and fold each tile into a running softmax. ``load_block_ids`` and
``attend_tile`` are that walk's two halves, so the kernels differ only in which query rows they
hold and which positions those rows may see.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels take exp2, so the launchers scale by log2(e)
MIN_DOT = 16  # smallest dimension tl.dot accepts
NO_WINDOW = 2**31 - 1  # a sliding window longer than any context: plain causal attention


@dataclass(frozen=True)
class KernelConfig:
    """Launch settings for one dtype, chosen so ptxas reports no spills on sm_80, sm_89 and sm_90
    (``tests/test_kernel_compile.py`` compiles every variant for both and checks).

    fp32 dots must ask for IEEE precision, as the default, TF32, keeps only a 10-bit mantissa;
    they then run on CUDA cores with register-held tiles, which need more warps and, in prefill,
    shorter tiles to fit.
    """

    dot_precision: str | None
    decode_num_warps: int
    prefill_block_n: int
    prefill_num_warps: int


def kernel_config(dtype: torch.dtype) -> KernelConfig:
    if dtype == torch.float32:
        return KernelConfig(dot_precision="ieee", decode_num_warps=8, prefill_block_n=16, prefill_num_warps=8)
    return KernelConfig(dot_precision=None, decode_num_warps=4, prefill_block_n=64, prefill_num_warps=8)


def kernel_window(sliding_window: int | None) -> int:
    """The window as the kernels take it: every launch passes one, ``NO_WINDOW`` for full causal attention."""
    if sliding_window is None:
        return NO_WINDOW
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be None or at least 1, got {sliding_window}")
    return sliding_window


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
