"""Paged prefill attention: packed query tokens of many sequences, causal, over the paged cache.

A sequence's query rows are the last ``query_len`` of its ``context_len`` positions, so the same
kernel serves a whole prompt, a prompt whose first blocks were already cached (prefix caching,
chunked prefill) and single decode tokens mixed into the batch. K/V always come from the cache:
the step's new tokens are stored before attention runs.

One program takes ``BLOCK_Q`` query tokens of one sequence and all query heads of one kv head,
flattened into ``BLOCK_Q * GROUP_PAD`` rows (row ``r`` is token ``r // GROUP_PAD``, head
``r % GROUP_PAD`` of the group), so each K/V tile it loads serves the whole group. Its keys run
from the oldest position its first query sees (0, or the start of that query's sliding window)
to its last query, in tiles whose block ids are loaded a tile ahead, as in decode.

The grid is one program per query block, not per sequence times the longest query: sequence
``i``'s blocks are numbered from ``query_start[i] // BLOCK_Q + i``, which leaves each sequence
at least the ``cdiv(query_len, BLOCK_Q)`` numbers it needs and keeps every number below
``num_tokens // BLOCK_Q + num_seqs``. A program finds its sequence by binary search over
``query_start``, on the device, so the launch needs nothing read back from it. A step of 64
decodes beside one 4k-token chunk launches about 64 + 4096 / BLOCK_Q programs per kv head.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlib.kernels.attention_tiles import (LOG2E, MIN_DOT, attend_tile, device_capability, kernel_config,
                                          kernel_window, load_block_ids, output_for)


@triton.jit
def _find_query_block(query_start_ptr, program, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence program ``program`` serves and the first of its query rows (see the module doc)."""
    lo = 0
    hi = num_seqs  # the first number of sequence lo is <= program, that of sequence hi (or the end) above it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= program:
            lo = mid
        else:
            hi = mid
    return lo, (program - tl.load(query_start_ptr + lo) // BLOCK_Q - lo) * BLOCK_Q


@triton.jit(do_not_specialize=["num_seqs"])  # varies from step to step: one compiled variant for all
def _paged_prefill_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, query_start_ptr,
    qk_scale, window, num_seqs,
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
    seq, first = _find_query_block(query_start_ptr, tl.program_id(0), num_seqs, BLOCK_Q)
    kv_head = tl.program_id(1)
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

    # Keys before the first query's window or past the last query are masked for every row: skip them.
    first_pos = context_len - query_len + first
    start = tl.maximum(first_pos - window + 1, 0)
    end = tl.minimum(context_len, first_pos + BLOCK_Q)
    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bts
    n = tl.arange(0, BLOCK_N)
    block = load_block_ids(table, start + n, end, stride_btb, BLOCK_SIZE)
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        valid = pos < end
        next_block = load_block_ids(table, pos + BLOCK_N, end, stride_btb, BLOCK_SIZE)  # the next tile's, now
        offset = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k_ptrs = (k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_kt
                  + kv_head * stride_kh + d[None, :] * stride_kd)
        v_ptrs = (v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vt
                  + kv_head * stride_vh + d[None, :] * stride_vd)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        m, l, acc = attend_tile(q, m, l, acc, k_ptrs, v_ptrs, kv_mask, visible, qk_scale, DOT_PRECISION)
        block = next_block

    acc = acc / tl.where(l > 0, l, 1.0)[:, None]  # only rows past the query, never stored, can see nothing
    tl.store(out_ptr + (query_begin + t)[:, None] * stride_ot + heads[:, None] * stride_oh
             + d[None, :] * stride_od, acc.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, query_start: torch.Tensor,
                            max_query_len: int, scale: float, sliding_window: int | None = None,
                            block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed ``query`` ``[num_tokens, num_heads, head_dim]`` over the paged cache.

    Sequence ``i`` owns rows ``query_start[i] .. query_start[i+1]-1`` (``query_start`` is
    ``[num_seqs + 1]`` int32), which sit at the last positions of its ``context_lens[i]`` tokens.
    ``max_query_len`` (at least every query length) is the metadata's; the grid no longer needs
    it, being sized by the token count. With ``sliding_window`` ``w``, each query sees only the
    last ``w`` positions up to its own.

    ``block_m`` (query rows per program), ``block_n`` (context tokens per loop step), ``num_warps`` and
    ``num_stages`` are launch tunables, passable per call so a benchmark can sweep them; None takes the dtype's
    ``kernel_config`` (Triton's default stages). The result is written into ``out`` when given (``output_for``).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if query.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise TypeError(f"query, k_cache and v_cache must share a dtype, got {query.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    window = kernel_window(sliding_window)
    out = output_for(query, out)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    config = kernel_config(query.dtype, device_capability(query.device))
    block_q = max(1, (block_m or config.prefill_block_m) // group_pad)  # query rows: tokens x group heads
    stages = {} if num_stages is None else {"num_stages": num_stages}
    _paged_prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        out, query, k_cache, v_cache, block_tables, context_lens, query_start,
        scale * LOG2E, window, num_seqs,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_N=block_n or config.prefill_block_n,
        DOT_PRECISION=config.dot_precision, num_warps=num_warps or config.prefill_num_warps, **stages,
    )
    return out
