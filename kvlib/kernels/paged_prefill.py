"""Paged prefill attention: packed query tokens of many sequences, causal, over the paged cache.

A sequence's query rows are the last ``query_len`` of its ``context_len`` positions, so the same
kernel serves a whole prompt, a prompt whose first blocks were already cached (prefix caching,
chunked prefill) and single decode tokens mixed into the batch. K/V always come from the cache:
the step's new tokens are stored before attention runs.

One program takes ``BLOCK_Q`` query tokens of one sequence and all query heads of one kv head,
flattened into ``BLOCK_Q * GROUP_PAD`` rows (row ``r`` is token ``r // GROUP_PAD``, head
``r % GROUP_PAD`` of the group), so each K/V tile it loads serves the whole group.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # query rows (tokens x group heads) per program, at least MIN_DOT whatever the group
MIN_DOT = 16  # smallest dimension tl.dot accepts
LOG2E = 1.4426950408889634


@triton.jit
def _paged_prefill_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, query_start_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.program_id(2) * BLOCK_Q
    query_begin = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_begin
    if first >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    t = first + r // GROUP_PAD
    g = r % GROUP_PAD
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g
    row_mask = ((t < query_len) & (g < GROUP))[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + (query_begin + t)[:, None] * stride_qt + heads[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=row_mask, other=0.0)
    q_pos = context_len - query_len + t

    # Keys past the tile's last query position are masked for every row: stop before them.
    end = tl.minimum(context_len, context_len - query_len + first + BLOCK_Q)
    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile in range(0, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(block_tables_ptr + seq * stride_bts + (pos // BLOCK_SIZE) * stride_btb,
                        mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_kt
                    + kv_head * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vt
                    + kv_head * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    acc = acc / l[:, None]
    tl.store(out_ptr + (query_begin + t)[:, None] * stride_ot + heads[:, None] * stride_oh
             + d[None, :] * stride_od, acc.to(out_ptr.dtype.element_ty), mask=row_mask)


def _dtype_config(dtype: torch.dtype) -> dict:
    """Launch settings by dtype (sizes chosen so ptxas reports no spills on sm_80 and sm_90).

    fp32 dots must ask for IEEE precision, as the default, TF32, keeps only a 10-bit mantissa;
    they then run on CUDA cores with register-held tiles, which must shrink to fit.
    """
    if dtype == torch.float32:
        return dict(DOT_PRECISION="ieee", BLOCK_N=32, num_warps=8)
    return dict(DOT_PRECISION=None, BLOCK_N=64, num_warps=8)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, query_start: torch.Tensor,
                            max_query_len: int, scale: float) -> torch.Tensor:
    """Causal attention of packed ``query`` ``[num_tokens, num_heads, head_dim]`` over the paged cache.

    Sequence ``i`` owns rows ``query_start[i] .. query_start[i+1]-1`` (``query_start`` is
    ``[num_seqs + 1]`` int32), which sit at the last positions of its ``context_lens[i]`` tokens.
    ``max_query_len`` must be at least every sequence's query length; it sizes the grid.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if query.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise TypeError(f"query, k_cache and v_cache must share a dtype, got {query.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    out = torch.empty_like(query)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, BLOCK_M // group_pad)
    _paged_prefill_kernel[(num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))](
        out, query, k_cache, v_cache, block_tables, context_lens, query_start,
        scale * LOG2E,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, **_dtype_config(query.dtype),
    )
    return out
