"""Paged attention in torch that keeps up with a real model on a CPU.

The reference (``torch_backend.paged_attention_reference``) is written to be read; these are
written to be fast and must agree with it. Where K/V are gathered (prefill, and decode on a pool
the in-place path below refuses), two habits make the difference:

- K/V are copied out of the pool once, as whole blocks of one layer (each block's layer slice is
  one contiguous run, so ``index_select`` moves it with a plain memory copy), and only the blocks
  a query can see: with a sliding window, the window's blocks, not the whole context.
- No further copies: the matmuls read the gathered ``[..., tokens, kv_heads, head_dim]`` tensor
  through strided views, one kv head at a time, so grouped-query attention never repeats K/V.

Decode reads K/V in place where the pool's layout allows it (``paged_decode_in_place``, what the
backend runs on a float32 pool): each layer's cache is one matrix of ``head_dim`` rows over the
pool's memory, a step's visible positions are a sparse pattern over those rows, and torch's sparse
kernels compute ``q.k`` at exactly those rows (``sampled_addmm``) and ``embedding_bag`` sums those rows weighted
by ``p``, with nothing copied. Otherwise it plans its reads once per step (``decode_groups``,
kept in ``meta.derive``) and gathers a few megabytes at a time, so what it has just copied is still
in cache when the matmuls read it.

Prefill goes through ``scaled_dot_product_attention`` a chunk of queries at a time, so a call
holds at most ``SCORE_BUDGET`` scores (or one query's, if more) even where SDPA falls back to
materializing them, never the ``[heads, L, L]`` of a whole prompt.
"""
from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlib.attention.metadata import AttentionMetadata

MAX_QUERY_CHUNK = 256  # query tokens per SDPA call at most
SCORE_BUDGET = 1 << 24  # scores per SDPA call at most (64 MiB in float32): fewer queries when keys are many
SCRATCH_ELEMENTS = 1 << 22  # elements of each reused gather buffer (16 MiB in float32)
DECODE_GROUP_BYTES = 4 << 20  # K and V a group of decodes gathers per layer: they stay in cache for the matmuls
# torch says so once per process on the first sparse CSR tensor; the two kernels used here are tested against the reference
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


class GatherScratch:
    """Reused destinations for the per-layer K/V gathers, so the pool's blocks land in memory already mapped.

    A fresh multi-MiB tensor is fresh pages: on a CPU, faulting in an 8 MiB gather costs 5-10 ms,
    several times the copy itself, in every layer of every step. Each named buffer grows to the
    largest request seen, at most ``max_elements``; a larger request gets a fresh tensor.
    """

    def __init__(self, max_elements: int = SCRATCH_ELEMENTS):
        self.max_elements = max_elements
        self.buffers: dict[str, torch.Tensor] = {}

    def tensor(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        if numel > self.max_elements:
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = self.buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel].view(shape)


def read_blocks(cache: torch.Tensor, block_ids: torch.Tensor, scratch: GatherScratch | None = None,
                name: str = "") -> torch.Tensor:
    """Blocks ``block_ids`` ``[n]`` of one layer's cache, copied into ``[n, block_size, kv_heads, head_dim]``.

    The copy lands in ``scratch``'s buffer ``name`` when given (valid until that buffer's next use).
    """
    shape = (block_ids.shape[0], *cache.shape[1:])
    out = torch.empty(shape, dtype=cache.dtype, device=cache.device) if scratch is None else (
        scratch.tensor(name, shape, cache))
    if cache[0].is_contiguous():  # the pool's layout: each block is one run of memory
        torch.index_select(cache.flatten(1), 0, block_ids, out=out.view(shape[0], -1))
    else:
        torch.index_select(cache, 0, block_ids, out=out)
    return out


@dataclass
class DecodeGroup:
    """Sequences of one decode step read together: their rows, the blocks they read, what they may not see."""

    rows: torch.Tensor  # [n] int64, rows of the step's query
    block_ids: torch.Tensor  # [n * num_cols] int64, num_cols consecutive table columns per sequence
    bias: torch.Tensor  # [n, 1, num_cols * block_size] float32: 0 where visible, -inf elsewhere


def decode_groups(meta: AttentionMetadata, block_size: int, block_bytes: int, budget_bytes: int) -> list[DecodeGroup]:
    """The step's decodes, longest first, cut into groups whose K and V fit ``budget_bytes``.

    Each sequence reads the columns of its block table from the block holding the first position it
    can see (0 without a window) up to its group's longest context; positions outside ``first ..
    context_len-1`` are masked, including the table's padding. Sorting by length keeps the padding
    small when lengths differ; small groups keep a layer's gathered K/V in cache for the matmuls.
    """
    _, context_lens = meta.host_lengths
    window = meta.sliding_window
    device = meta.block_tables.device
    order = sorted(range(len(context_lens)), key=lambda i: -context_lens[i])
    groups, start = [], 0
    while start < len(order):
        longest = context_lens[order[start]]
        num_cols = -(-longest // block_size)
        if window is not None:
            num_cols = min(num_cols, -(-(window - 1) // block_size) + 1)
        n = max(1, min(len(order) - start, budget_bytes // (2 * num_cols * block_bytes)))
        rows = torch.tensor(order[start:start + n], device=device)
        lens = meta.context_lens[rows].long()
        first = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
        cols = first[:, None] // block_size + torch.arange(num_cols, device=device)  # [n, num_cols]
        tables = meta.block_tables[rows]
        block_ids = tables.gather(1, cols.clamp(max=tables.shape[1] - 1)).long().flatten()
        positions = (cols[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
        hidden = (positions < first[:, None]) | (positions >= lens[:, None])  # [n, num_cols * block_size]
        bias = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))[:, None, :]
        groups.append(DecodeGroup(rows, block_ids, bias))
        start += n
    return groups


def paged_decode_batched(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, scratch: GatherScratch | None = None) -> torch.Tensor:
    """Decode (one query per sequence): per group of sequences (``decode_groups``, planned once per step),
    one gather of K and of V, then one masked softmax.

    With ``scratch``, a group's K/V fit its buffers as well as the cache budget.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    block_bytes = k_cache[0].numel() * k_cache.element_size()
    budget = DECODE_GROUP_BYTES if scratch is None else min(DECODE_GROUP_BYTES,
                                                            2 * scratch.max_elements * k_cache.element_size())
    groups = meta.derive(f"decode groups {block_size} {block_bytes} {budget}",
                         lambda: decode_groups(meta, block_size, block_bytes, budget))
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype, device=query.device)
    for group in groups:
        n = group.rows.shape[0]
        keys = read_blocks(k_cache, group.block_ids, scratch, "k").view(n, -1, kv_heads, head_dim)  # [n, tokens, kv, d]
        values = read_blocks(v_cache, group.block_ids, scratch, "v").view(n, -1, kv_heads, head_dim)
        out[group.rows] = _attend_decode(query[group.rows], keys.float(), values.float(), group.bias, scale)
    return out


def _attend_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """``query`` ``[seqs, heads, d]`` over gathered ``keys``/``values`` ``[seqs, tokens, kv_heads, d]``.

    One kv head at a time, through strided views of the gathered tensors: no further copies, the kv
    head's whole query group is one matmul, and the mask is added by the same call (``baddbmm``).
    """
    num_seqs, num_heads, head_dim = query.shape
    kv_heads = keys.shape[2]
    q = (query.float() * scale).view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.empty(kv_heads, num_seqs, num_heads // kv_heads, keys.shape[1], device=query.device)
    for h in range(kv_heads):
        torch.baddbmm(bias, q[:, h], keys[:, :, h].transpose(1, 2), out=scores[h])  # [seqs, group, tokens]
    probs = scores.softmax(dim=-1)
    out = torch.empty(kv_heads, num_seqs, num_heads // kv_heads, head_dim, device=query.device)
    for h in range(kv_heads):
        torch.bmm(probs[h], values[:, :, h], out=out[h])
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim).to(query.dtype)


IN_PLACE_DTYPES = (torch.float32,)  # what torch's CPU sparse kernels compute in: sampled_addmm has no half kernels


def rows_in_place(cache: torch.Tensor) -> torch.Tensor | None:
    """One layer's cache ``[blocks, block_size, kv_heads, head_dim]`` as a ``[rows, head_dim]`` view of the pool's
    memory: kv head ``h`` of token ``o`` in block ``b`` is row ``b * block_rows + o * kv_heads + h``, with
    ``block_rows = cache.stride(0) // head_dim``. The view ends at the last block's last row, so K and V of every
    layer have the same rows and one sparse pattern serves them all. None where the layout or the device does
    not allow it."""
    blocks, block_size, kv_heads, head_dim = cache.shape
    stride = cache.stride()
    if (cache.device.type != "cpu" or cache.dtype not in IN_PLACE_DTYPES or stride[0] % head_dim
            or tuple(stride[1:]) != (kv_heads * head_dim, head_dim, 1)):
        return None
    rows = (blocks - 1) * (stride[0] // head_dim) + block_size * kv_heads
    return cache.as_strided((rows, head_dim), (head_dim, 1))


@dataclass
class DecodePattern:
    """A decode step's visible positions as one sparse matrix over the rows of ``rows_in_place``."""

    sampled: torch.Tensor  # [seqs * heads, rows] sparse CSR, every row ``width`` entries: where sampled_addmm computes
    col: torch.Tensor  # [seqs * heads * width] int64, its column indices: the same for K and V and for every layer
    offsets: torch.Tensor  # [seqs * heads] int64, where each row's entries start (embedding_bag's offsets)
    bias: torch.Tensor  # [seqs * heads, width] float32: 0 where visible, -inf on the padding


def decode_pattern(meta: AttentionMetadata, block_size: int, block_rows: int, num_heads: int,
                   kv_heads: int, num_cache_rows: int) -> DecodePattern:
    """Row ``i * heads + q`` (sequence ``i``, query head ``q``) reads kv head ``q // group`` at the positions it
    sees, ``first .. context_len-1`` (``first`` is 0 without a window), padded to the step's widest by repeating
    its first position, masked."""
    _, context_lens = meta.host_lengths
    lens = meta.context_lens.long()
    window = meta.sliding_window
    first = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
    width = max(n if window is None else min(n, window) for n in context_lens)
    positions = first[:, None] + torch.arange(width, device=lens.device)  # [seqs, width]
    hidden = positions >= lens[:, None]
    positions = torch.where(hidden, first[:, None], positions)
    blocks = meta.block_tables.gather(1, positions // block_size).long()
    base = blocks * block_rows + (positions % block_size) * kv_heads  # [seqs, width]: kv head 0's rows
    heads = torch.arange(num_heads, device=lens.device) // (num_heads // kv_heads)
    col = (base[:, None, :] + heads[None, :, None]).flatten()
    num_rows = len(context_lens) * num_heads
    crow = torch.arange(num_rows + 1, device=lens.device) * width
    sampled = torch.sparse_csr_tensor(crow, col, torch.zeros(col.shape), (num_rows, num_cache_rows),
                                      check_invariants=False)
    bias = torch.zeros(hidden.shape, device=lens.device).masked_fill_(hidden, float("-inf"))
    return DecodePattern(sampled, col, crow[:-1], bias[:, None, :].expand(-1, num_heads, -1).reshape(num_rows, width))


def paged_decode_in_place(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor | None:
    """Decode (one query per sequence) reading K/V where they lie in the pool: ``q.k`` sampled at the visible
    rows, a dense softmax over them, ``p.v`` summed from the same rows (``embedding_bag``, each row's
    probabilities its weights); None where ``rows_in_place`` refuses the caches."""
    k_rows, v_rows = rows_in_place(k_cache), rows_in_place(v_cache)
    if k_rows is None or v_rows is None or query.dtype != k_cache.dtype or k_cache.stride(0) != v_cache.stride(0):
        return None
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    block_rows = k_cache.stride(0) // head_dim
    num_cache_rows = k_rows.shape[0]
    pattern = meta.derive(f"in-place pattern {block_size} {block_rows} {num_heads} {kv_heads} {num_cache_rows}",
                          lambda: decode_pattern(meta, block_size, block_rows, num_heads, kv_heads, num_cache_rows))
    scores = torch.sparse.sampled_addmm(pattern.sampled, query.reshape(num_seqs * num_heads, head_dim), k_rows.T,
                                        beta=0.0, alpha=scale)
    probs = scores.values().view(pattern.bias.shape).add_(pattern.bias).softmax(dim=-1)
    out = F.embedding_bag(pattern.col, v_rows, pattern.offsets, mode="sum", per_sample_weights=probs.flatten())
    return out.view(num_seqs, num_heads, head_dim)


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, scratch: GatherScratch | None = None) -> torch.Tensor:
    """Decode in place where the caches allow it (``paged_decode_in_place``), else in gathered groups."""
    out = paged_decode_in_place(query, k_cache, v_cache, meta, scale)
    return paged_decode_batched(query, k_cache, v_cache, meta, scale, scratch) if out is None else out


def paged_prefill_sequence(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, context_len: int, scale: float,
                           sliding_window: int | None = None, scratch: GatherScratch | None = None) -> torch.Tensor:
    """One sequence's last ``query_len`` positions ``[query_len, heads, head_dim]``, a chunk of queries at a time.

    The query group of each kv head is folded into SDPA's query axis (``[kv_heads, group x chunk,
    head_dim]``), so SDPA sees as many heads as K/V have and K/V are never repeated.
    """
    query_len, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    device = query.device
    first_query = context_len - query_len
    first_key = 0 if sliding_window is None else max(0, first_query - sliding_window + 1)
    first_block = first_key // block_size
    block_ids = block_table[first_block:-(-context_len // block_size)].to(device).long()
    skip = first_key - first_block * block_size  # positions of the first block before the first key
    keys = read_blocks(k_cache, block_ids, scratch, "k").flatten(0, 1)[skip:context_len - first_block * block_size]
    values = read_blocks(v_cache, block_ids, scratch, "v").flatten(0, 1)[skip:context_len - first_block * block_size]
    keys, values = keys.transpose(0, 1).float(), values.transpose(0, 1).float()  # [kv_heads, keys, head_dim]
    key_pos = first_key + torch.arange(keys.shape[1], device=device)

    out = torch.empty_like(query)
    chunk = max(1, min(MAX_QUERY_CHUNK, SCORE_BUDGET // (num_heads * keys.shape[1])))
    for start in range(0, query_len, chunk):
        rows = query[start:start + chunk].float()
        n = rows.shape[0]
        q_pos = first_query + start + torch.arange(n, device=device)
        # The chunk sees keys from its first query's window start to its last query: slice just those.
        begin = 0 if sliding_window is None else max(0, first_query + start - sliding_window + 1) - first_key
        end = first_query + start + n - first_key
        pos = key_pos[begin:end]
        visible = pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        folded = rows.view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, head_dim)
        attended = F.scaled_dot_product_attention(folded[None], keys[None, :, begin:end], values[None, :, begin:end],
                                                  attn_mask=visible.repeat(group, 1), scale=scale)
        out[start:start + n] = attended.view(kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(
            n, num_heads, head_dim).to(query.dtype)
    return out


def paged_attention_mixed(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, scratch: GatherScratch | None = None) -> torch.Tensor:
    """A step with prefills: its decode rows go through the batched decode together, the rest one sequence each."""
    query_lens, context_lens = meta.host_lengths
    starts = [0, *itertools.accumulate(query_lens)]
    out = torch.empty_like(query)
    decoding = meta.derive("decode rows", lambda: _decode_rows(meta, starts))
    if decoding is not None:
        rows, decode_meta = decoding
        out[rows] = paged_decode(query[rows], k_cache, v_cache, decode_meta, scale, scratch)
    for i, n in enumerate(query_lens):
        if n > 1:
            out[starts[i]:starts[i + 1]] = paged_prefill_sequence(
                query[starts[i]:starts[i + 1]], k_cache, v_cache, meta.block_tables[i], context_lens[i], scale,
                meta.sliding_window, scratch)
    return out


def _decode_rows(meta: AttentionMetadata, starts: list[int]) -> tuple[torch.Tensor, AttentionMetadata] | None:
    """The query rows of a mixed step's single-token sequences and their own metadata (None if there are none)."""
    query_lens, context_lens = meta.host_lengths
    decoding = [i for i, n in enumerate(query_lens) if n == 1]
    if not decoding:
        return None
    index = torch.tensor(decoding, device=meta.block_tables.device)
    rows = torch.tensor([starts[i] for i in decoding], device=meta.slot_mapping.device)
    return rows, AttentionMetadata(
        slot_mapping=meta.slot_mapping[:0], block_tables=meta.block_tables[index], context_lens=meta.context_lens[index],
        query_start=torch.arange(len(decoding) + 1, dtype=torch.int32, device=index.device),
        max_query_len=1, max_context_len=max(context_lens[i] for i in decoding), sliding_window=meta.sliding_window,
        num_decodes=len(decoding))
