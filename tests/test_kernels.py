"""The Triton kernels against the torch reference.

The kernels run in Triton's interpreter unless TRITON_INTERPRET=0 is set (do that on a GPU to
test the compiled kernels), so shapes stay small: 2 kv heads, head dim 32, up to 5 sequences of
up to 100 tokens. Every attention case draws its own lengths, most ending mid-block, and shuffled
block tables; the caches are always strided views of a 6-d pool, as the engine passes them.
Sliding windows range from 1 position to longer than every context.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import dataclasses  # noqa: E402
import itertools  # noqa: E402
import math  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvlib import kernels  # noqa: E402
from kvlib.attention.metadata import AttentionMetadata  # noqa: E402
from kvlib.attention.torch_backend import (  # noqa: E402
    TorchAttentionBackend,
    paged_attention_reference,
    store_kv_reference,
)
from kvlib.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kvlib.cli.bench import kernels as bench  # noqa: E402
from kvlib.cli.bench.kernels import decode_case, run_kernel_bench  # noqa: E402
from kvlib.kernels import paged_prefill  # noqa: E402
from kvlib.kernels.attention_tiles import kernel_config  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] == "0" else "cpu"
KV_HEADS = 2
HEAD_DIM = 32
NUM_LAYERS = 2
LAYER = 1  # not layer 0, so the views start at an offset into the pool
SCALE = 0.17
FP16, FP32, BF16 = torch.float16, torch.float32, torch.bfloat16
TOLERANCE = {FP32: dict(atol=2e-5, rtol=1e-4), FP16: dict(atol=3e-3, rtol=3e-3), BF16: dict(atol=2e-2, rtol=2e-2)}
NEEDS_GPU = pytest.mark.skipif(DEVICE != "cuda", reason="bf16 needs a GPU: the interpreter computes through numpy")
GRID = list(itertools.product((1, 16, 32), (1, 2, 4), (FP32, FP16)))  # block size, GQA ratio, dtype


def case_id(block_size, group, dtype):
    return f"bs{block_size}-gqa{group}-{str(dtype).removeprefix('torch.')}"


def random_lengths(seed, min_len=1):
    """1 to 5 context lengths in ``min_len .. 100``."""
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 6, (1,), generator=gen))
    return torch.randint(min_len, 101, (batch,), generator=gen).tolist()


def make_pool(num_blocks, block_size, dtype, head_dim=HEAD_DIM, seed=0):
    """A pool ``[blocks, layers, 2, block_size, kv_heads, head_dim]`` and one layer's K and V views."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, NUM_LAYERS, 2, block_size, KV_HEADS, head_dim)
    data = torch.randn(shape, generator=gen).to(dtype=dtype, device=DEVICE)
    return data, data[:, LAYER, 0], data[:, LAYER, 1]


def make_block_tables(context_lens, block_size, seed=0):
    """Disjoint, shuffled block ids for each sequence, padded with 0; also the pool size they need."""
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 3
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.zeros(len(context_lens), max(needed) + 1, dtype=torch.int32)
    for i, count in enumerate(needed):
        tables[i, :count] = torch.tensor(ids[:count])
        ids = ids[count:]
    return tables.to(DEVICE), num_blocks


def make_meta(context_lens, query_lens, block_tables, block_size, window=None):
    """Metadata for one step; the slots are those of each sequence's last ``query_len`` positions."""
    starts = [0]
    slots = []
    for i, (n, q) in enumerate(zip(context_lens, query_lens)):
        starts.append(starts[-1] + q)
        for pos in range(n - q, n):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, device=DEVICE)  # noqa: E731
    return AttentionMetadata(
        slot_mapping=as_tensor(slots, torch.int64), block_tables=block_tables,
        context_lens=as_tensor(context_lens, torch.int32), query_start=as_tensor(starts, torch.int32),
        max_query_len=max(query_lens), max_context_len=max(context_lens), sliding_window=window)


def randn(*shape, dtype=FP32, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


def check_decode(context_lens, block_size, group, dtype, head_dim=HEAD_DIM, num_splits=1, window=None, **tunables):
    tables, num_blocks = make_block_tables(context_lens, block_size)
    _, k_cache, v_cache = make_pool(num_blocks, block_size, dtype, head_dim)
    meta = make_meta(context_lens, [1] * len(context_lens), tables, block_size, window)
    query = randn(len(context_lens), KV_HEADS * group, head_dim, dtype=dtype)
    out = kernels.paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.context_lens, SCALE,
                                         max_context_len=meta.max_context_len, num_splits=num_splits,
                                         sliding_window=window, **tunables)
    expected = paged_attention_reference(query, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def check_prefill(context_lens, query_lens, block_size, group, dtype, window=None, **tunables):
    tables, num_blocks = make_block_tables(context_lens, block_size)
    _, k_cache, v_cache = make_pool(num_blocks, block_size, dtype)
    meta = make_meta(context_lens, query_lens, tables, block_size, window)
    query = randn(sum(query_lens), KV_HEADS * group, HEAD_DIM, dtype=dtype)
    out = kernels.paged_prefill_attention(query, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                          meta.query_start, meta.max_query_len, SCALE, sliding_window=window,
                                          **tunables)
    expected = paged_attention_reference(query, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size, group, dtype", GRID, ids=[case_id(*case) for case in GRID])
def test_decode_matches_reference(block_size, group, dtype):
    check_decode(random_lengths(seed=GRID.index((block_size, group, dtype))), block_size, group, dtype)


@pytest.mark.parametrize("context_lens, block_size, group, dtype", [
    pytest.param([1], 1, 1, FP32, id="one-token"),
    pytest.param([16, 32, 64, 1], 16, 2, FP32, id="full-blocks"),
    pytest.param([90, 3, 128], 128, 4, FP32, id="block-size-128"),
    pytest.param([65, 64, 63], 64, 8, FP32, id="one-tile-plus-one-gqa8"),
    pytest.param([70, 3, 45], 16, 2, BF16, id="bf16", marks=NEEDS_GPU),
])
def test_decode_edge_cases(context_lens, block_size, group, dtype):
    check_decode(context_lens, block_size, group, dtype)


@pytest.mark.parametrize("head_dim", [64, 96, 128])  # 96 is padded to 128 inside the kernel
def test_decode_head_dims(head_dim):
    check_decode([40, 9], 16, 2, FP32, head_dim=head_dim)


SPLIT_GRID = [(1, 2, 4), (16, 1, 3), (16, 4, 7), (32, 2, 2), (32, 4, 5)]  # block size, GQA ratio, splits


@pytest.mark.parametrize("dtype", [FP32, FP16], ids=["float32", "float16"])
@pytest.mark.parametrize("block_size, group, num_splits", SPLIT_GRID,
                         ids=[f"bs{b}-gqa{g}-splits{n}" for b, g, n in SPLIT_GRID])
def test_split_decode_matches_reference(block_size, group, num_splits, dtype):
    # Each sequence is cut by its own length; those shorter than 16 tokens a split use fewer splits.
    context_lens = [100] + random_lengths(seed=SPLIT_GRID.index((block_size, group, num_splits)))
    check_decode(context_lens, block_size, group, dtype, num_splits=num_splits)


WINDOW_GRID = [(16, 2, 1, 1), (16, 1, 8, 1), (4, 4, 13, 1), (32, 2, 64, 1), (16, 2, 200, 1),
               (16, 2, 40, 3), (1, 4, 70, 4), (32, 1, 17, 2)]  # block size, GQA ratio, window, splits


@pytest.mark.parametrize("block_size, group, window, num_splits", WINDOW_GRID,
                         ids=[f"bs{b}-gqa{g}-window{w}-splits{n}" for b, g, w, n in WINDOW_GRID])
def test_decode_sliding_window_matches_reference(block_size, group, window, num_splits):
    context_lens = [100] + random_lengths(seed=200 + WINDOW_GRID.index((block_size, group, window, num_splits)))
    check_decode(context_lens, block_size, group, FP32, num_splits=num_splits, window=window)


DECODE_TUNINGS = [(16, 4, 2, 1), (32, 8, 4, 3), (128, 4, 3, 1), (128, None, None, 5), (64, 4, 3, 70)]  # + splits


@pytest.mark.parametrize("block_n, num_warps, num_stages, num_splits", DECODE_TUNINGS,
                         ids=[f"block-n{b}-warps{w}-stages{s}-splits{n}" for b, w, s, n in DECODE_TUNINGS])
def test_decode_tunables_match_reference(block_n, num_warps, num_stages, num_splits):
    """Every launch tuning the bench sweeps computes the same attention, split or not; 70 splits of a
    1,100-token context take the merge past one ``MERGE_CHUNK`` of splits."""
    context_lens = [1100, 33] if num_splits == 70 else [100, *random_lengths(seed=block_n + num_splits)]
    check_decode(context_lens, 16, 4, FP32, num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                 num_stages=num_stages)


@pytest.mark.parametrize("block_n", [0, 8, 48])
def test_decode_refuses_a_tile_tl_dot_cannot_take(block_n):
    with pytest.raises(ValueError, match="block_n"):
        check_decode([20], 16, 2, FP32, block_n=block_n)


def test_split_rule(monkeypatch):
    """On a fake 132-SM device: splits until one wave of the programs a multiprocessor holds, none under 256 tokens."""
    assert kernels.choose_num_splits(1, 8, 32768, torch.device("cpu")) == 1
    props = types.SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    cuda = torch.device("cuda")
    assert kernels.choose_num_splits(1, 8, 32768, cuda, per_sm=4) == 64  # 8 programs want 66 splits: MAX_SPLITS
    assert kernels.choose_num_splits(2, 8, 32768, cuda, per_sm=4) == 33  # 16 programs x 33 = 528 = 4 per SM
    assert kernels.choose_num_splits(2, 8, 32768, cuda) == 24  # 3 per SM before a kernel was compiled here
    assert kernels.choose_num_splits(1, 8, 2048, cuda) == 8  # no split shorter than 256 tokens
    assert kernels.choose_num_splits(1, 8, 512, cuda) == 2  # short contexts split too, when the device is idle
    assert kernels.choose_num_splits(1, 8, 500, cuda) == 1
    assert kernels.choose_num_splits(32, 8, 4096, cuda, per_sm=4) == 2  # 256 programs, about 2 per SM, become 4
    assert kernels.choose_num_splits(32, 8, 4096, cuda, per_sm=3) == 1  # 512 would be 1.3 waves of 3 per SM
    assert kernels.choose_num_splits(64, 8, 4096, cuda) == 1
    assert kernels.choose_num_splits(256, 8, 1024, cuda) == 1


@pytest.mark.parametrize("num_splits", [2, 5, 8])
def test_each_sequence_splits_its_own_context(num_splits):
    """A CUDA graph's bound (max_model_len) far above every context: each sequence is cut by its own length
    (a length fixed by the bound put every context in the first split), and the result stays exact."""
    context_lens = [300, 17, 1, 160, 95, 64]
    tables, num_blocks = make_block_tables(context_lens, 16)
    _, k_cache, v_cache = make_pool(num_blocks, 16, FP32, HEAD_DIM)
    meta = make_meta(context_lens, [1] * len(context_lens), tables, 16, None)
    query = randn(len(context_lens), KV_HEADS * 2, HEAD_DIM, dtype=FP32)
    out = kernels.paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.context_lens, SCALE,
                                         max_context_len=131072, num_splits=num_splits)
    expected = paged_attention_reference(query, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(out, expected, **TOLERANCE[FP32])


def random_prefill_step(seed):
    """Each sequence is a whole prompt, a prompt behind a cached prefix, or a single decode token."""
    gen = torch.Generator().manual_seed(seed)
    context_lens = random_lengths(seed)
    query_lens = []
    for n in context_lens:
        kind = int(torch.randint(3, (1,), generator=gen))
        query_lens.append([n, int(torch.randint(1, n + 1, (1,), generator=gen)), 1][kind])
    if max(query_lens) == 1:
        query_lens[0] = context_lens[0]  # a decode-only step is not a prefill case
    return context_lens, query_lens


@pytest.mark.parametrize("block_size, group, dtype", GRID, ids=[case_id(*case) for case in GRID])
def test_prefill_matches_reference(block_size, group, dtype):
    check_prefill(*random_prefill_step(seed=100 + GRID.index((block_size, group, dtype))), block_size, group, dtype)


PREFILL_WINDOWS = [(16, 2, 1), (16, 1, 8), (4, 4, 13), (32, 2, 64), (16, 8, 200)]  # block size, GQA ratio, window


@pytest.mark.parametrize("block_size, group, window", PREFILL_WINDOWS,
                         ids=[f"bs{b}-gqa{g}-window{w}" for b, g, w in PREFILL_WINDOWS])
def test_prefill_sliding_window_matches_reference(block_size, group, window):
    context_lens, query_lens = random_prefill_step(seed=300 + PREFILL_WINDOWS.index((block_size, group, window)))
    check_prefill([100, *context_lens], [100, *query_lens], block_size, group, FP32, window=window)


def test_prefill_grid_follows_the_work(monkeypatch):
    """64 decode rows beside one long chunk launch programs for the chunk's query blocks, plus one per sequence.

    The grid used to be sequences x kv heads x (longest query / BLOCK_Q): here 65 x 2 x 64 programs,
    all but a few hundred exiting at once. Nothing runs: the launch is recorded.
    """
    launches = []
    monkeypatch.setattr(paged_prefill, "_paged_prefill_kernel", RecordingKernel(launches))
    context_lens, query_lens = [4096] + [300] * 64, [4096] + [1] * 64
    tables, num_blocks = make_block_tables(context_lens, 16)
    meta = make_meta(context_lens, query_lens, tables, 16)
    cache = torch.empty(num_blocks, 16, KV_HEADS, HEAD_DIM)
    query = torch.empty(sum(query_lens), KV_HEADS, HEAD_DIM)
    kernels.paged_prefill_attention(query, cache, cache, meta.block_tables, meta.context_lens, meta.query_start,
                                    meta.max_query_len, SCALE)
    (grid,) = launches
    block_q = kernel_config(query.dtype).prefill_block_m  # one query head per kv head: a program's rows are all tokens
    needed = sum(-(-n // block_q) for n in query_lens) * KV_HEADS
    assert needed <= math.prod(grid) <= needed + len(query_lens) * KV_HEADS


class RecordingKernel:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records the grid instead of launching."""

    def __init__(self, launches):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(grid)


PREFILL_TUNINGS = [(128, 32, 4, 2, 2), (32, 128, 8, None, 4), (16, 16, None, None, 2), (128, 64, 8, 3, 8)]


@pytest.mark.parametrize("block_m, block_n, num_warps, num_stages, group", PREFILL_TUNINGS,
                         ids=[f"block-m{m}-block-n{n}-warps{w}-stages{s}-gqa{g}" for m, n, w, s, g in PREFILL_TUNINGS])
def test_prefill_tunables_match_reference(block_m, block_n, num_warps, num_stages, group):
    """Every launch tuning the bench sweeps computes the same attention: prompts, cached prefixes, decodes."""
    check_prefill([100, 37, 90, 5], [100, 20, 45, 1], 16, group, FP32, block_m=block_m, block_n=block_n,
                  num_warps=num_warps, num_stages=num_stages)


@pytest.mark.parametrize("context_lens, query_lens, block_size, group, dtype", [
    pytest.param([100], [100], 16, 1, FP32, id="prompt-over-two-programs"),
    pytest.param([37, 100, 5], [37, 20, 1], 16, 2, FP32, id="cached-prefix-and-decode"),
    pytest.param([64, 33, 90, 1], [64, 1, 45, 1], 32, 8, FP32, id="gqa8"),
    pytest.param([77, 50], [77, 13], 32, 2, BF16, id="bf16", marks=NEEDS_GPU),
])
def test_prefill_edge_cases(context_lens, query_lens, block_size, group, dtype):
    check_prefill(context_lens, query_lens, block_size, group, dtype)


@pytest.mark.parametrize("block_size, key_dtype, cache_dtype", [
    pytest.param(1, FP32, FP32, id="bs1-float32"),
    pytest.param(16, FP32, FP32, id="bs16-float32"),
    pytest.param(32, FP16, FP16, id="bs32-float16"),
    pytest.param(16, FP32, FP16, id="float32-into-float16-cache"),
])
def test_store_kv_matches_reference(block_size, key_dtype, cache_dtype):
    data, k_cache, v_cache = make_pool(16, block_size, cache_dtype)
    expected, k_expected, v_expected = make_pool(16, block_size, cache_dtype)
    num_tokens = 9
    slots = torch.randperm(16 * block_size, generator=torch.Generator().manual_seed(3))[:num_tokens]
    slots[[2, 5]] = -1
    slots = slots.to(DEVICE)
    key = randn(num_tokens, KV_HEADS, HEAD_DIM, dtype=key_dtype, seed=4)
    value = randn(num_tokens, KV_HEADS, HEAD_DIM, dtype=key_dtype, seed=5)
    kernels.store_kv(key, value, k_cache, v_cache, slots)
    store_kv_reference(key, value, k_expected, v_expected, slots)
    torch.testing.assert_close(data, expected, atol=0, rtol=0)


@pytest.mark.parametrize("skipped", [[], [2, 5]], ids=["every slot", "two skipped"])
@pytest.mark.parametrize("cache_dtype", [FP32, FP16])
def test_the_torch_backends_store_matches_the_reference(skipped, cache_dtype):
    """Its mask-free path on a CPU (no slot skipped, same dtype) and the reference it falls back on write alike."""
    data, k_cache, v_cache = make_pool(16, 16, cache_dtype)
    expected, k_expected, v_expected = make_pool(16, 16, cache_dtype)
    slots = torch.randperm(16 * 16, generator=torch.Generator().manual_seed(3))[:9]
    slots[skipped] = -1
    slots = slots.to(DEVICE)
    key = randn(9, KV_HEADS + 1, HEAD_DIM, dtype=cache_dtype, seed=4)[:, :KV_HEADS]  # strided, as the model's
    value = randn(9, KV_HEADS, HEAD_DIM, dtype=cache_dtype, seed=5)
    TorchAttentionBackend().store_kv(key, value, k_cache, v_cache, slots)
    store_kv_reference(key, value, k_expected, v_expected, slots)
    torch.testing.assert_close(data, expected, atol=0, rtol=0)



def test_the_torch_backends_store_keeps_its_rows_only_for_the_same_unchanged_slots():
    """It works out a step's rows once and keeps them for the next layer's call; a slot mapping changed in place
    (a reused input buffer) or another one, or a pool with other blocks, must get rows of its own."""
    backend = TorchAttentionBackend()
    data, _, _ = make_pool(16, 16, FP32)
    expected = data.clone()
    other, _, _ = make_pool(12, 8, FP32, seed=1)
    other_expected = other.clone()
    gen = torch.Generator().manual_seed(6)
    slots = torch.randperm(12 * 8, generator=gen)[:5].to(DEVICE)  # slots both pools have

    def store(pool, reference, layer, slots, seed):
        key, value = randn(5, KV_HEADS, HEAD_DIM, seed=seed), randn(5, KV_HEADS, HEAD_DIM, seed=seed + 1)
        backend.store_kv(key, value, pool[:, layer, 0], pool[:, layer, 1], slots)
        store_kv_reference(key, value, reference[:, layer, 0], reference[:, layer, 1], slots)

    for layer in range(NUM_LAYERS):  # every layer of one step: the same slot mapping
        store(data, expected, layer, slots, 10 + layer)
    slots.copy_(torch.randperm(12 * 8, generator=gen)[:5])  # the same tensor, new slots
    store(data, expected, 0, slots, 20)
    store(other, other_expected, 0, slots, 30)  # 8-token blocks: other rows for the same slots
    store(data, expected, 1, torch.randperm(16 * 16, generator=gen)[:5].to(DEVICE), 40)
    torch.testing.assert_close(data, expected, atol=0, rtol=0)
    torch.testing.assert_close(other, other_expected, atol=0, rtol=0)

def test_copy_blocks_matches_indexing():
    data, _, _ = make_pool(8, 16, FP32)
    expected = data.clone()
    src, dst = [1, 1, 4], [0, 6, 7]
    expected[dst] = expected[src]
    kernels.copy_blocks(data, src, dst)
    torch.testing.assert_close(data, expected, atol=0, rtol=0)
    kernels.copy_blocks(data, torch.tensor([], dtype=torch.int64), [])
    torch.testing.assert_close(data, expected, atol=0, rtol=0)
    with pytest.raises(ValueError):
        kernels.copy_blocks(data, [1, 2], [3])


@pytest.mark.parametrize("dtype, chunk", [(FP16, 64), (FP32, 4096), (BF16, 128)],
                         ids=["float16", "float32", "bfloat16"])
def test_copy_blocks_across_pools_is_exact(dtype, chunk):
    """Scattered blocks of one pool onto scattered blocks of another, bytes unchanged, in chunks smaller and larger
    than a block; nothing else of the destination is touched."""
    src, _, _ = make_pool(9, 16, FP32, seed=2)
    src = src.to(dtype)
    dst = torch.zeros(12, *src.shape[1:], dtype=dtype, device=DEVICE)
    expected = dst.clone()
    src_ids, dst_ids = [8, 0, 3, 5], [11, 2, 7, 0]
    expected[dst_ids] = src[src_ids]
    as_ids = lambda ids: torch.tensor(ids, dtype=torch.int64, device=DEVICE)  # noqa: E731
    kernels.copy_blocks_across(src, dst, as_ids(src_ids), as_ids(dst_ids), chunk=chunk)
    assert torch.equal(dst, expected)


def test_copy_blocks_across_refuses_mismatched_pools():
    src, _, _ = make_pool(4, 16, FP32)
    ids = torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match="different blocks"):
        kernels.copy_blocks_across(src, torch.zeros(4, 1, device=DEVICE), ids, ids)
    with pytest.raises(ValueError, match="destination"):
        kernels.copy_blocks_across(src, torch.zeros_like(src), ids, torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.copy_blocks_across(src[:, :, :, :8], torch.zeros_like(src[:, :, :, :8]), ids, ids)


def test_backend_matches_torch_backend():
    """A prefill step then a decode step through both backends, with q/k/v sliced from one fused tensor."""
    block_size, group = 16, 2
    context_lens, query_lens = [45, 20, 61], [45, 3, 30]
    tables, num_blocks = make_block_tables([n + 1 for n in context_lens], block_size)
    data, _, _ = make_pool(num_blocks, block_size, FP32)
    steps = [(context_lens, query_lens), ([n + 1 for n in context_lens], [1] * len(context_lens))]
    results = {}
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        pool = data.clone()
        k_cache, v_cache = pool[:, LAYER, 0], pool[:, LAYER, 1]
        outputs = []
        for seed, (step_context, step_query) in enumerate(steps):
            meta = make_meta(step_context, step_query, tables, block_size)
            qkv = randn(sum(step_query), KV_HEADS * (group + 2), HEAD_DIM, seed=seed)
            query, key, value = qkv.split([KV_HEADS * group, KV_HEADS, KV_HEADS], dim=1)
            backend.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
            outputs.append(backend.forward(query, k_cache, v_cache, meta, SCALE))
        results[backend.name] = (outputs, pool)
    (triton_outputs, triton_pool), (torch_outputs, torch_pool) = results["triton"], results["torch"]
    torch.testing.assert_close(triton_pool, torch_pool, atol=0, rtol=0)
    for got, want in zip(triton_outputs, torch_outputs):
        torch.testing.assert_close(got, want, **TOLERANCE[FP32])


def test_backend_mixed_step_matches_torch_backend():
    """Decodes packed first, then prefills, in one step: the two kernels write their rows of one output in place."""
    block_size, group = 16, 2
    context_lens, query_lens = [30, 50, 64], [1, 1, 14]
    tables, num_blocks = make_block_tables(context_lens, block_size)
    data, _, _ = make_pool(num_blocks, block_size, FP32)
    meta = dataclasses.replace(make_meta(context_lens, query_lens, tables, block_size), num_decodes=2)
    query = randn(sum(query_lens), KV_HEADS * group, HEAD_DIM, seed=3)
    got, want = (backend.forward(query, data[:, LAYER, 0], data[:, LAYER, 1], meta, SCALE)
                 for backend in (TritonAttentionBackend(), TorchAttentionBackend()))
    torch.testing.assert_close(got, want, **TOLERANCE[FP32])


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_launchers_write_into_the_output_they_are_given(kernel):
    block_size, context_lens = 16, [20, 37]
    query_lens = [1, 1] if kernel == "decode" else [20, 5]
    tables, num_blocks = make_block_tables(context_lens, block_size)
    _, k_cache, v_cache = make_pool(num_blocks, block_size, FP32)
    meta = make_meta(context_lens, query_lens, tables, block_size)
    query = randn(sum(query_lens), KV_HEADS, HEAD_DIM, seed=4)

    def launch(**out):
        if kernel == "decode":
            return kernels.paged_decode_attention(query, k_cache, v_cache, tables, meta.context_lens, SCALE, **out)
        return kernels.paged_prefill_attention(query, k_cache, v_cache, tables, meta.context_lens, meta.query_start,
                                               meta.max_query_len, SCALE, **out)
    whole = torch.full((len(query) + 2, KV_HEADS, HEAD_DIM), 7.0, device=DEVICE)
    view = whole[1:-1]
    assert launch(out=view) is view
    torch.testing.assert_close(view, launch(), atol=0, rtol=0)
    assert (whole[0] == 7).all() and (whole[-1] == 7).all()  # nothing outside the rows it was given
    with pytest.raises(ValueError, match="out must match the query's shape"):
        launch(out=whole)


def test_backend_copy_blocks():
    data, _, _ = make_pool(5, 16, FP16)
    expected = data.clone()
    expected[3] = expected[0]
    TritonAttentionBackend().copy_blocks(data, [0], [3])
    torch.testing.assert_close(data, expected, atol=0, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_kernel_bench_is_empty_without_cuda():
    assert run_kernel_bench() == []


def test_kernel_bench_refuses_gpus_below_sm80(monkeypatch, capsys):
    from kvlib.cli.bench import kernels as bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert bench.main([]) == 1
    assert "Tesla T4 has compute capability 7.5" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="8.0"):
        run_kernel_bench()


def test_kernel_bench_baseline_computes_the_same_attention():
    """The SDPA baseline the bench times must do the kernel's work, or the comparison means nothing."""
    paged, sdpa, _ = decode_case(batch=2, context=40, device=DEVICE, dtype=FP16)
    torch.testing.assert_close(paged(2), sdpa(), **TOLERANCE[FP16])


def test_kernel_bench_baseline_reads_each_layer():
    """Calls on different layers of the pool (what a graph replay walks) each match SDPA over that layer."""
    paged, sdpa, _ = decode_case(batch=2, context=40, device=DEVICE, dtype=FP32, layers=2)
    for layer in range(2):
        torch.testing.assert_close(paged(3, layer, block_n=32), sdpa(layer), **TOLERANCE[FP32])
    assert not torch.allclose(sdpa(0), sdpa(1))


def test_kernel_bench_decode_under_a_graphs_longer_bound_computes_the_same_attention():
    """The graph-split part times the kernel told a bound far past the real contexts (a graph bucket's)."""
    paged, sdpa, _ = decode_case(batch=2, context=40, device=DEVICE, dtype=FP32)
    torch.testing.assert_close(paged(None, max_context_len=4096), sdpa(), **TOLERANCE[FP32])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_sweeps_are_empty_without_cuda():
    assert bench.decode_sweep() == [] and bench.prefill_bench() == []


def test_decode_sweep_stays_within_its_compile_budget():
    """The sweep's variants compile few kernels: one decode kernel per (plain or split, tuning), one merge per
    power of two of the split counts; the rule's count at 1 x 32k is whatever a device gives, 49 on an H200."""
    decode, merges = set(), set()
    for batch, context in bench.SHAPES:
        for splits, tuning in bench.decode_variants(batch, context, auto_splits=49 if batch == 1 else 1):
            decode.add((splits > 1, tuning))
            if splits > 1:
                merges.add(1 << (splits - 1).bit_length())
    assert len(decode) + len(merges) <= 40
    assert len(bench.PREFILL_TUNINGS) <= 8


def test_causal_flops_count_the_visible_pairs_only():
    for query_len, context_len in [(1, 1), (3, 5), (2048, 8192), (8192, 8192)]:
        pairs = sum(context_len - query_len + i + 1 for i in range(query_len))
        assert bench.causal_pairs(query_len, context_len) == pairs
    assert bench.attention_flops(4, 2048, 8192) == 4 * 4 * bench.causal_pairs(2048, 8192) * 128 * 32


@pytest.mark.parametrize("num_seqs, query_len, context_len", [(2, 20, 40), (1, 24, 24)], ids=["chunk", "fresh"])
def test_prefill_bench_baseline_computes_the_same_attention(num_seqs, query_len, context_len):
    """The SDPA twin (lower-right causal mask behind a prefix, ``is_causal`` when fresh) matches the kernel."""
    paged, sdpa_inputs = bench.prefill_case(num_seqs, query_len, context_len, DEVICE, FP32)
    sdpa, path = bench.sdpa_causal(*sdpa_inputs)
    expected = sdpa().transpose(1, 2).reshape(num_seqs * query_len, bench.NUM_HEADS, bench.HEAD_DIM)
    torch.testing.assert_close(paged(block_m=32, block_n=16), expected, **TOLERANCE[FP32])
    assert path in {"flash_attention", "efficient_attention", "cudnn_attention", "math"}


def test_missing_triton_fails_only_on_use(monkeypatch):
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(ImportError, match="Triton"):
        kernels.paged_decode_attention  # noqa: B018
    with pytest.raises(ImportError, match="Triton"):
        TritonAttentionBackend()


@pytest.fixture
def fake_h200(monkeypatch):
    """The bench's GPU-only measuring functions run here on CPU tensors, their timers stubbed: what is checked is
    the rows they build (every variant run once, the rows plain JSON), not any time. Heads are few and small."""
    for name, value in [("NUM_HEADS", 4), ("NUM_KV_HEADS", 2), ("HEAD_DIM", 32)]:
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(bench, "eager_ms", lambda fn: (fn(), 0.01)[1])
    monkeypatch.setattr(bench, "graph_ms", lambda calls: (calls[-1](), 0.005)[1])
    real_decode_case, real_prefill_case = bench.decode_case, bench.prefill_case
    monkeypatch.setattr(bench, "decode_case", lambda batch, context, device, dtype, layers=1: real_decode_case(
        batch, context, DEVICE, dtype, layers))
    monkeypatch.setattr(bench, "prefill_case", lambda seqs, query_len, context_len, device, dtype: real_prefill_case(
        seqs, query_len, context_len, DEVICE, dtype))


def test_decode_sweep_rows(fake_h200):
    import json
    rows = bench.decode_sweep(shapes=[(1, 96), (2, 32)], dtype=FP32)
    json.dumps(rows)
    assert not [r for r in rows if "error" in r]
    assert {r["shape"] for r in rows} == {"1 x 96", "2 x 32"}
    sdpa = [r for r in rows if r["variant"] == "torch sdpa, contiguous"]
    assert len(sdpa) == 2 and all(r["graph x sdpa"] == 1 for r in sdpa)
    kernel = [r for r in rows if r["splits"] is not None]
    assert all(r["graph x sdpa"] == 1 and r["eager us"] == 10 and r["graph us"] == 5 for r in kernel)
    assert {r["block_n"] for r in kernel} == {32, 64, 128}


def test_prefill_bench_rows(fake_h200):
    import json
    rows = bench.prefill_bench(cases=[(2, 16, 40), (1, 24, 24)], dtype=FP32,
                               tunings=[bench.DEFAULT_PREFILL_TUNING, (32, 16, 4, 2)])
    json.dumps(rows)
    assert [r["case"] for r in rows] == ["2 x 16 behind 24 cached"] * 3 + ["1 x 24 fresh"] * 3
    assert rows[0]["implementation"].startswith("torch sdpa (") and rows[0]["x sdpa"] == 1
    assert rows[3]["TFLOP/s"] == 4 * bench.causal_pairs(24, 24) * 32 * 4 / 0.01 / 1e9


def test_prefill_takes_the_tiles_measured_fastest_on_hopper_and_the_unspilled_ones_elsewhere():
    hopper, ampere, ada = (kernel_config(torch.bfloat16, c) for c in ((9, 0), (8, 0), (8, 9)))
    assert (hopper.prefill_block_m, hopper.prefill_block_n, hopper.prefill_num_warps) == (128, 32, 4)
    assert ampere == ada == kernel_config(torch.bfloat16)  # before Hopper the 128-row tile spills: the 64 x 64 stays
    assert (ampere.prefill_block_m, ampere.prefill_block_n, ampere.prefill_num_warps) == (64, 64, 8)
    assert kernel_config(torch.float32, (9, 0)) == kernel_config(torch.float32)  # fp32 tiles are not the 16-bit ones


@pytest.mark.parametrize("triton_version, numpy_version, blocked", [
    ("3.6.0", "2.4.6", True),  # Triton 3.6 (torch 2.11's) with today's NumPy: every decode launch failed deep in Triton
    ("3.0.0", "2.4.0", True),
    ("3.6.0", "2.3.5", False),
    ("3.7.0", "2.4.6", False),  # Triton 3.7 squeezes the array first
    ("3.9.0", "2.4.6", False),
    ("3.6.0", "1.26.4", False),
    ("3.10.0+git1234", "2.10.1", False),
])
def test_an_interpreter_that_cannot_run_beside_this_numpy_is_named_with_what_to_do(triton_version, numpy_version,
                                                                                    blocked):
    from kvlib.kernels.attention_tiles import interpreter_blocker
    message = interpreter_blocker(triton_version, numpy_version)
    assert (message is not None) == blocked
    if blocked:
        assert f"Triton {triton_version}" in message and f"NumPy {numpy_version}" in message
        assert "pip install 'numpy<2.4'" in message and "attention_backend='torch'" in message
