"""Paged decode attention: one new query token per sequence, over K/V spread across cache blocks.

One program serves one (sequence, kv head) pair and the whole query group of that kv head, so
each K/V token is read from memory once however many query heads share it (GQA). The group is
padded to 16 rows because ``tl.dot`` needs every dimension to be at least 16; the padding rows
cost a little arithmetic, and decode is bound by memory, not arithmetic.

Long contexts with few sequences leave most of the device idle, so there is a split-KV variant
(flash-decoding): the context is cut into splits, each program attends to one split and writes a
partial output with its log-sum-exp, and a second kernel merges the splits. ``choose_num_splits``
holds the rule for when that pays.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # context tokens per loop step
MIN_DOT = 16  # smallest dimension tl.dot accepts
MIN_SPLIT_TOKENS = 512  # shortest split the rule makes, so partial writes and the merge stay small next to the reads
MAX_SPLITS = 64  # most splits the rule makes
SPLIT_ALIGN = 16  # split lengths are rounded up to a multiple of this many tokens
LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr,
    qk_scale, split_size,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_os, stride_oh, stride_od,
    stride_ps, stride_ph, stride_pp, stride_pd,
    stride_ls, stride_lh, stride_lp,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    if SPLIT:
        split = tl.program_id(2)
        start = split * split_size
        if start >= context_len:
            return
        end = tl.minimum(start + split_size, context_len)
    else:
        start = 0
        end = context_len

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g
    row_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_mask, other=0.0)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(block_tables_ptr + seq * stride_bts + (pos // BLOCK_SIZE) * stride_btb,
                        mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_kt
                    + kv_head * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vt
                    + kv_head * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    acc = acc / l[:, None]
    if SPLIT:
        tl.store(part_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + split * stride_pp
                 + d[None, :] * stride_pd, acc, mask=row_mask)
        tl.store(part_lse_ptr + seq * stride_ls + heads * stride_lh + split * stride_lp,
                 m + tl.log2(l), mask=g < GROUP)
    else:
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od,
                 acc.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, context_lens_ptr, split_size,
    stride_os, stride_oh, stride_od,
    stride_ps, stride_ph, stride_pp, stride_pd,
    stride_ls, stride_lh, stride_lp,
    NUM_SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """Weight each split's partial output by its share of the softmax mass, exp2(lse - max lse)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    num_valid = (context_len + split_size - 1) // split_size
    s = tl.arange(0, NUM_SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = s < num_valid
    lse = tl.load(part_lse_ptr + seq * stride_ls + head * stride_lh + s * stride_lp,
                  mask=s_mask, other=float("-inf"))
    weight = tl.where(s_mask, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    parts = tl.load(part_out_ptr + seq * stride_ps + head * stride_ph + s[:, None] * stride_pp
                    + d[None, :] * stride_pd, mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(weight[:, None] * parts, 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _dtype_config(dtype: torch.dtype) -> dict:
    """Launch settings by dtype (sizes chosen so ptxas reports no spills on sm_80 and sm_90).

    fp32 dots must ask for IEEE precision, as the default, TF32, keeps only a 10-bit mantissa;
    they then run on CUDA cores with register-held tiles, which need more warps to fit.
    """
    if dtype == torch.float32:
        return dict(DOT_PRECISION="ieee", num_warps=8)
    return dict(DOT_PRECISION=None, num_warps=4)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """How many splits decode should use: 1 unless the plain grid leaves the device underfilled.

    The plain kernel launches ``num_seqs * num_kv_heads`` programs. When that is fewer than the
    device has streaming multiprocessors, the context is split so the grid reaches about two
    programs per multiprocessor, with no split shorter than ``MIN_SPLIT_TOKENS`` tokens (so short
    contexts never split) and at most ``MAX_SPLITS`` splits. Off CUDA there is no multiprocessor
    count to fill, so the answer is always 1.
    """
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    wanted = math.ceil(2 * num_sms / programs)
    return max(1, min(wanted, max_context_len // MIN_SPLIT_TOKENS, MAX_SPLITS))


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           max_context_len: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Attention of ``query`` ``[num_seqs, num_heads, head_dim]`` over each sequence's whole context.

    ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` with any strides;
    ``block_tables`` is ``[num_seqs, max_blocks]`` int32 and ``context_lens`` ``[num_seqs]`` int32.
    ``max_context_len`` must be at least every context length; it sizes the splits and is read
    from ``context_lens`` (a device sync) when not given. ``num_splits`` forces the split count;
    None applies ``choose_num_splits``.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if query.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise TypeError(f"query, k_cache and v_cache must share a dtype, got {query.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, query.device)
    elif num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    split_size = triton.cdiv(triton.cdiv(max(max_context_len, 1), num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    num_splits = triton.cdiv(max(max_context_len, 1), split_size)

    group = num_heads // num_kv_heads
    head_dim_pad = max(MIN_DOT, triton.next_power_of_2(head_dim))
    split = num_splits > 1
    if split:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_strides = (*part_out.stride(), *part_lse.stride())
    else:  # the plain kernel writes ``out`` and never touches the partials
        part_out, part_lse, part_strides = out, out, (0,) * 7

    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_out, part_lse,
        query, k_cache, v_cache, block_tables, context_lens,
        scale * LOG2E, split_size,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        *part_strides,
        GROUP=group, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        SPLIT=split, **_dtype_config(query.dtype),
    )
    if split:
        _merge_splits_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, context_lens, split_size,
            *out.stride(), *part_out.stride(), *part_lse.stride(),
            NUM_SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        )
    return out
