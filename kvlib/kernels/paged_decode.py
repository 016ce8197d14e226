"""Paged decode attention: one new query token per sequence, over K/V spread across cache blocks.

One program serves one (sequence, kv head) pair and the whole query group of that kv head, so
each K/V token is read from memory once however many query heads share it (GQA). The group is
padded to 16 rows because ``tl.dot`` needs every dimension to be at least 16; the padding rows
cost a little arithmetic, and decode is bound by memory, not arithmetic.

The block ids of each tile are loaded one iteration ahead of its K/V. A K/V address that needs a
load from the same iteration first cannot be issued early, so Triton's pipeliner would give K
and V one shared-memory buffer each and every tile would wait for its own loads; with the ids in
hand a tile early, the loads of tile i+1 fly while tile i is computed (``tests/test_kernel_compile.py``
checks the compiled kernel for it).

With a sliding window the loop starts at the tile holding the oldest visible position, so a long
context costs only its window.

Long contexts with few sequences leave most of the device idle, so there is a split-KV variant
(flash-decoding): the visible context is cut into splits, each program attends to one split and
writes a partial output with its log-sum-exp, and a second kernel merges the splits.
``choose_num_splits`` holds the rule for when that pays.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlib.kernels.attention_tiles import LOG2E, MIN_DOT, attend_tile, kernel_config, kernel_window, load_block_ids

BLOCK_N = 64  # context tokens per loop step
PROGRAMS_PER_SM = 4  # the split rule aims at this many programs per multiprocessor, to hide memory latency
MIN_SPLIT_TOKENS = 256  # shortest split the rule makes, so partial writes and the merge stay small next to the reads
MAX_SPLITS = 64  # most splits the rule makes
SPLIT_ALIGN = 16  # split lengths are rounded up to a multiple of this many tokens


# Integers that change from step to step are not specialized on (1, or a multiple of 16): each new value
# would otherwise be a new compiled variant in the middle of serving.
SPLIT_VARYING = ["split_size", "stride_ps", "stride_ph", "stride_pp", "stride_ls", "stride_lh"]


@triton.jit(do_not_specialize=SPLIT_VARYING)
def _paged_decode_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr,
    qk_scale, split_size, window,
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
    first = tl.maximum(context_len - window, 0)  # the oldest position the query sees
    if SPLIT:
        split = tl.program_id(2)
        start = first + split * split_size
        if start >= context_len:
            return
        end = tl.minimum(start + split_size, context_len)
    else:
        start = first
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
        m, l, acc = attend_tile(q, m, l, acc, k_ptrs, v_ptrs, kv_mask, valid[None, :], qk_scale, DOT_PRECISION)
        block = next_block

    acc = acc / l[:, None]
    if SPLIT:
        tl.store(part_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + split * stride_pp
                 + d[None, :] * stride_pd, acc, mask=row_mask)
        tl.store(part_lse_ptr + seq * stride_ls + heads * stride_lh + split * stride_lp,
                 m + tl.log2(l), mask=g < GROUP)
    else:
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od,
                 acc.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=SPLIT_VARYING)
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, context_lens_ptr, split_size, window,
    stride_os, stride_oh, stride_od,
    stride_ps, stride_ph, stride_pp, stride_pd,
    stride_ls, stride_lh, stride_lp,
    NUM_SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """Weight each split's partial output by its share of the softmax mass, exp2(lse - max lse)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    visible = tl.minimum(tl.load(context_lens_ptr + seq), window)
    num_valid = (visible + split_size - 1) // split_size
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


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """How many splits decode should use: enough for ``PROGRAMS_PER_SM`` programs per multiprocessor.

    The plain kernel launches ``num_seqs * num_kv_heads`` programs, each walking one context. Decode
    waits on memory, and one program per multiprocessor cannot keep enough loads in flight to
    hide that wait, so the rule aims at ``PROGRAMS_PER_SM`` programs on every multiprocessor: each
    context (``max_context_len``: the longest visible stretch, the window where there is one) is
    cut into the most splits that keep the grid within that target, so a grid just short of it is
    left alone rather than doubled. No split is shorter than ``MIN_SPLIT_TOKENS`` tokens, so the
    partial results and the merge stay small next to the K/V each split reads, and there are at
    most ``MAX_SPLITS``. Off CUDA there is no multiprocessor count to fill: the answer is 1.
    """
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = PROGRAMS_PER_SM * num_sms // (num_seqs * num_kv_heads)
    return max(1, min(wanted, max_context_len // MIN_SPLIT_TOKENS, MAX_SPLITS))


def split_warm_up_bounds() -> tuple[int, ...]:
    """Context bounds at which ``choose_num_splits`` picks 2, 4 ... ``MAX_SPLITS`` splits on a large enough GPU:
    each of those counts launches a merge width (``NUM_SPLITS_PAD``) of its own, compiled at its first launch."""
    bounds, splits = [], 2
    while splits <= MAX_SPLITS:
        bounds.append(splits * MIN_SPLIT_TOKENS)
        splits *= 2
    return tuple(bounds)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           max_context_len: int | None = None, num_splits: int | None = None,
                           sliding_window: int | None = None) -> torch.Tensor:
    """Attention of ``query`` ``[num_seqs, num_heads, head_dim]`` over each sequence's context.

    ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` with any strides;
    ``block_tables`` is ``[num_seqs, max_blocks]`` int32 and ``context_lens`` ``[num_seqs]`` int32.
    ``max_context_len`` must be at least every context length; it sizes the splits and is read
    from ``context_lens`` (a device sync) when not given. ``num_splits`` forces the split count;
    None applies ``choose_num_splits``. With ``sliding_window`` ``w``, each query sees only the last
    ``w`` positions of its context.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if query.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise TypeError(f"query, k_cache and v_cache must share a dtype, got {query.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    window = kernel_window(sliding_window)
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    span = max(min(max_context_len, window), 1)  # the longest stretch of positions any query sees
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, span, query.device)
    elif num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    split_size = triton.cdiv(triton.cdiv(span, num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    num_splits = triton.cdiv(span, split_size)

    group = num_heads // num_kv_heads
    head_dim_pad = max(MIN_DOT, triton.next_power_of_2(head_dim))
    config = kernel_config(query.dtype)
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
        scale * LOG2E, split_size, window,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        *part_strides,
        GROUP=group, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        SPLIT=split, DOT_PRECISION=config.dot_precision, num_warps=config.decode_num_warps,
    )
    if split:
        _merge_splits_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, context_lens, split_size, window,
            *out.stride(), *part_out.stride(), *part_lse.stride(),
            NUM_SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        )
    return out
