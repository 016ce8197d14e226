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
``choose_num_splits`` holds the rule for when that pays: it fixes the split *count*, and each
sequence's split *length* comes from its own context, in the kernel (``split_length``). A CUDA
graph replays one count per batch bucket whatever the contexts are, so a batch of 4k-token
contexts under a bound of 131,072 still spreads over every split (a length fixed by the bound put
each whole context in the first split and left the other programs idle).

The rule aims at as many programs per multiprocessor as the compiled kernel fits there, read from
its registers and shared memory (``programs_per_sm``) after its first launch on the device, not a
constant; ``DEFAULT_PROGRAMS_PER_SM`` (what the sm_90 compile fits) stands in before that.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlib.kernels.attention_tiles import (
    LOG2E,
    MIN_DOT,
    attend_tile,
    kernel_config,
    kernel_window,
    load_block_ids,
    output_for,
)

BLOCK_N = 64  # context tokens per loop step
DEFAULT_PROGRAMS_PER_SM = 3  # programs of the split kernel one multiprocessor holds, before one was compiled here
MIN_SPLIT_TOKENS = 256  # shortest split the rule makes, so partial writes and the merge stay small next to the reads
MAX_SPLITS = 64  # most splits the rule makes
MERGE_CHUNK = MAX_SPLITS  # splits the merge kernel reads at a time: any count the rule picks in one pass
SPLIT_ALIGN = 16  # split lengths are rounded up to a multiple of this many tokens
MAX_PROGRAMS_PER_SM = 32  # resident blocks per multiprocessor, compute capability 8.0 to 9.0
REGISTER_GRANULE = 256  # registers are allocated to a warp in units of this many
RESERVED_SHARED = 1024  # shared memory the driver reserves per resident block (8.0+)

# Integers that change from step to step are not specialized on (1, or a multiple of 16): each new value
# would otherwise be a new compiled variant in the middle of serving.
SPLIT_VARYING = ["num_splits", "min_split", "stride_ps", "stride_ph", "stride_pp", "stride_ls", "stride_lh"]
_occupancy: dict[tuple, int] = {}  # (device, dtype, group pad, head dim pad, block size) -> programs per SM


@triton.jit
def split_length(visible, num_splits, min_split, ALIGN: tl.constexpr):
    """Tokens per split of a sequence that sees ``visible`` positions: a ``num_splits``-th of them, rounded up to
    ``ALIGN``, at least ``min_split`` (so a short context uses fewer splits, the rest returning at once)."""
    return tl.maximum(tl.cdiv(tl.cdiv(visible, num_splits), ALIGN) * ALIGN, min_split)


@triton.jit(do_not_specialize=SPLIT_VARYING)
def _paged_decode_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr,
    qk_scale, num_splits, min_split, window,
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
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    first = tl.maximum(context_len - window, 0)  # the oldest position the query sees
    if SPLIT:
        split = tl.program_id(2)
        split_size = split_length(context_len - first, num_splits, min_split, ALIGN)
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
    out_ptr, part_out_ptr, part_lse_ptr, context_lens_ptr, num_splits, min_split, window,
    stride_os, stride_oh, stride_od,
    stride_ps, stride_ph, stride_pp, stride_pd,
    stride_ls, stride_lh, stride_lp,
    NUM_SPLITS_PAD: tl.constexpr, MERGE_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Weight each split's partial output by its share of the softmax mass, exp2(lse - max lse).

    The partial outputs are read ``MERGE_CHUNK`` splits at a time, only as far as the sequence's splits go, so
    a forced split count past the rule's ``MAX_SPLITS`` keeps its tile in registers (a ``[256, 128]`` fp32
    tile read at once spilled)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    visible = tl.minimum(tl.load(context_lens_ptr + seq), window)
    num_valid = tl.cdiv(visible, split_length(visible, num_splits, min_split, ALIGN))
    s = tl.arange(0, NUM_SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    lse_ptrs = part_lse_ptr + seq * stride_ls + head * stride_lh
    max_lse = tl.max(tl.load(lse_ptrs + s * stride_lp, mask=s < num_valid, other=float("-inf")), 0)
    total = tl.zeros([HEAD_DIM_PAD], tl.float32)
    weight_sum = 0.0
    for first in range(0, num_valid, MERGE_CHUNK):
        c = first + tl.arange(0, MERGE_CHUNK)
        c_mask = c < num_valid
        weight = tl.where(c_mask, tl.exp2(tl.load(lse_ptrs + c * stride_lp, mask=c_mask, other=0.0) - max_lse), 0.0)
        parts = tl.load(part_out_ptr + seq * stride_ps + head * stride_ph + c[:, None] * stride_pp
                        + d[None, :] * stride_pd, mask=c_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        total += tl.sum(weight[:, None] * parts, 0)
        weight_sum += tl.sum(weight, 0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d * stride_od,
             (total / weight_sum).to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int, props) -> int:
    """Programs of a compiled kernel one multiprocessor holds at once: the least of what its threads, its
    registers (allocated per warp in ``REGISTER_GRANULE``s) and its shared memory (plus the driver's
    ``RESERVED_SHARED`` per block) allow. ``props``: ``torch.cuda.get_device_properties``'s fields."""
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    per_warp = -(-registers * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
    by_registers = props.regs_per_multiprocessor // max(per_warp, 1) // num_warps
    by_shared = (props.shared_memory_per_multiprocessor // (shared_bytes + RESERVED_SHARED) if shared_bytes
                 else MAX_PROGRAMS_PER_SM)
    return max(1, min(by_threads, by_registers, by_shared, MAX_PROGRAMS_PER_SM))


def record_occupancy(key: tuple, compiled, device: torch.device) -> None:
    """Note how many programs of a launched kernel fit a multiprocessor, from its compiled registers and
    shared memory (Triton's ``CompiledKernel``; the interpreter returns none, and nothing is noted)."""
    registers, metadata = getattr(compiled, "n_regs", None), getattr(compiled, "metadata", None)
    if key in _occupancy or not registers or metadata is None:
        return
    _occupancy[key] = programs_per_sm(registers, metadata.shared, metadata.num_warps,
                                      torch.cuda.get_device_properties(device))


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device,
                      per_sm: int | None = None) -> int:
    """How many splits decode should use: enough for ``per_sm`` programs on each multiprocessor.

    The plain kernel launches ``num_seqs * num_kv_heads`` programs, each walking one context. Decode
    waits on memory, and one program per multiprocessor cannot keep enough loads in flight to
    hide that wait, so the rule fills every multiprocessor with as many programs as it holds at
    once (``per_sm``, the compiled kernel's occupancy, ``DEFAULT_PROGRAMS_PER_SM`` when not known):
    each context (``max_context_len``: the longest visible stretch, the window where there is one,
    or a CUDA graph's bound) is cut into the most splits that keep the grid within one such wave,
    so a grid just short of it is left alone rather than doubled into a second, mostly idle wave.
    No split is shorter than ``MIN_SPLIT_TOKENS`` tokens, so the partial results and the merge stay
    small next to the K/V each split reads, and there are at most ``MAX_SPLITS``. Off CUDA there is
    no multiprocessor count to fill: the answer is 1.
    """
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = (per_sm or DEFAULT_PROGRAMS_PER_SM) * num_sms // (num_seqs * num_kv_heads)
    return max(1, min(wanted, max_context_len // MIN_SPLIT_TOKENS, MAX_SPLITS))


def working_splits(visible: int, num_splits: int, min_split: int = MIN_SPLIT_TOKENS) -> int:
    """Splits of a sequence that sees ``visible`` positions that hold any of them: the kernel's ``split_length``
    worked out on the host (for reports: the programs of a grid that do work)."""
    share = -(-visible // num_splits)
    length = max(-(-share // SPLIT_ALIGN) * SPLIT_ALIGN, min_split)
    return -(-visible // length)


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
                           sliding_window: int | None = None, block_n: int = BLOCK_N,
                           num_warps: int | None = None, num_stages: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``query`` ``[num_seqs, num_heads, head_dim]`` over each sequence's context, written into ``out``
    when given (``output_for``).

    ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` with any strides;
    ``block_tables`` is ``[num_seqs, max_blocks]`` int32 and ``context_lens`` ``[num_seqs]`` int32.
    ``max_context_len`` must be at least every context length; it bounds the split count and is
    read from ``context_lens`` (a device sync) when not given. ``num_splits`` forces the split
    count (each sequence cut into that many splits of at least ``SPLIT_ALIGN`` tokens); None applies
    ``choose_num_splits`` (splits of at least ``MIN_SPLIT_TOKENS``). Each sequence's split length is
    its own context's share. With ``sliding_window`` ``w``, each query sees only the last ``w``
    positions of its context.

    ``block_n`` (context tokens per loop step, a power of two of at least 16), ``num_warps`` (the dtype's
    ``kernel_config`` when None) and ``num_stages`` (Triton's default when None) are the decode kernel's launch
    tunables, passable per call so a benchmark can sweep them; the merge kernel keeps its own.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if query.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise TypeError(f"query, k_cache and v_cache must share a dtype, got {query.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if block_n < MIN_DOT or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two of at least {MIN_DOT}, got {block_n}")
    window = kernel_window(sliding_window)
    out = output_for(query, out)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    span = max(min(max_context_len, window), 1)  # the longest stretch of positions any query sees
    group = num_heads // num_kv_heads
    group_pad, head_dim_pad = max(MIN_DOT, triton.next_power_of_2(group)), max(MIN_DOT, triton.next_power_of_2(head_dim))
    occupancy_key = (query.device, query.dtype, group_pad, head_dim_pad, block_size)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, span, query.device, _occupancy.get(occupancy_key))
        min_split = MIN_SPLIT_TOKENS
    elif num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    else:
        min_split = SPLIT_ALIGN
    num_splits = min(num_splits, triton.cdiv(span, min_split))  # none that no sequence could fill
    config = kernel_config(query.dtype)
    stages = {} if num_stages is None else {"num_stages": num_stages}
    split = num_splits > 1
    if split:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_strides = (*part_out.stride(), *part_lse.stride())
    else:  # the plain kernel writes ``out`` and never touches the partials
        part_out, part_lse, part_strides = out, out, (0,) * 7

    compiled = _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_out, part_lse,
        query, k_cache, v_cache, block_tables, context_lens,
        scale * LOG2E, num_splits, min_split, window,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        *part_strides,
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        SPLIT=split, DOT_PRECISION=config.dot_precision, ALIGN=SPLIT_ALIGN,
        num_warps=num_warps or config.decode_num_warps, **stages,
    )
    if split:
        if query.device.type == "cuda" and (block_n, num_warps, num_stages) == (BLOCK_N, None, None):
            record_occupancy(occupancy_key, compiled, query.device)  # the rule is for the default launch only
        splits_pad = triton.next_power_of_2(num_splits)
        _merge_splits_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, context_lens, num_splits, min_split, window,
            *out.stride(), *part_out.stride(), *part_lse.stride(),
            NUM_SPLITS_PAD=splits_pad, MERGE_CHUNK=min(MERGE_CHUNK, splits_pad),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, ALIGN=SPLIT_ALIGN,
        )
    return out
