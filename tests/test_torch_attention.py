"""The torch backend's fast paths against the reference, and sliding windows in the reference itself.

Every case is a random step on a paged cache with shuffled blocks (strided views of a 6-d pool, as
the engine passes them): whole prompts, prompts behind a cached prefix, and decode tokens, mixed.
"""
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.attention import torch_paged
from kvlib.cli.bench import kernels as bench_kernels
from kvlib.attention.metadata import AttentionMetadata
from kvlib.attention.torch_backend import TorchAttentionBackend, gather_sequence_kv, paged_attention_reference

KV_HEADS = 2
HEAD_DIM = 16
SCALE = 0.3
EXACT = dict(atol=1e-5, rtol=1e-5)


def make_step(context_lens, query_lens, block_size, group, window=None, dtype=torch.float32, seed=0):
    """Query, one layer's K/V views of a 3-layer pool full of random data, and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 2
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(context_lens), max(needed) + 1, dtype=torch.int32)
    for i, count in enumerate(needed):
        tables[i, :count] = torch.tensor(ids[:count])
        ids = ids[count:]
    pool = torch.randn(num_blocks, 3, 2, block_size, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), KV_HEADS * group, HEAD_DIM, generator=gen).to(dtype)
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), block_tables=tables,
                             context_lens=torch.tensor(context_lens, dtype=torch.int32), query_start=starts,
                             max_query_len=max(query_lens), max_context_len=max(context_lens), sliding_window=window)
    return query, pool[:, 1, 0], pool[:, 1, 1], meta


@st.composite
def steps(draw, decode_only=False):
    """Up to 5 sequences of up to 90 tokens; each a decode token, a whole prompt or a cached-prefix chunk."""
    context_lens = draw(st.lists(st.integers(1, 90), min_size=1, max_size=5))
    query_lens = [1 if decode_only else draw(st.sampled_from([1, n, draw(st.integers(1, n))])) for n in context_lens]
    return dict(context_lens=context_lens, query_lens=query_lens, block_size=draw(st.sampled_from([1, 4, 16])),
                group=draw(st.sampled_from([1, 3, 4])), window=draw(st.sampled_from([None, 1, 5, 16, 33])),
                seed=draw(st.integers(0, 1000)))


@settings(max_examples=60, deadline=None)
@given(steps(decode_only=True))
def test_batched_decode_matches_reference(step):
    query, k_cache, v_cache, meta = make_step(**step)
    expected = paged_attention_reference(query, k_cache, v_cache, meta, SCALE)
    got = torch_paged.paged_decode_batched(query, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(got, expected, **EXACT)


@settings(max_examples=60, deadline=None)
@given(steps())
def test_backend_matches_reference(step):
    query, k_cache, v_cache, meta = make_step(**step)
    expected = paged_attention_reference(query, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(TorchAttentionBackend().forward(query, k_cache, v_cache, meta, SCALE), expected, **EXACT)


def test_prefill_in_query_chunks_matches_reference(monkeypatch):
    """A prompt longer than one chunk of queries, with and without a window that cuts keys per chunk."""
    monkeypatch.setattr(torch_paged, "MAX_QUERY_CHUNK", 16)
    for window in (None, 7, 40):
        query, k_cache, v_cache, meta = make_step([150, 70], [150, 61], 16, 2, window=window)
        expected = paged_attention_reference(query, k_cache, v_cache, meta, SCALE)
        torch.testing.assert_close(TorchAttentionBackend().forward(query, k_cache, v_cache, meta, SCALE), expected,
                                   **EXACT)


def test_gathers_larger_than_the_scratch():
    """A batch whose K/V outgrow the scratch buffers decodes in groups; a longer prompt gathers into a fresh tensor."""
    query, k_cache, v_cache, meta = make_step([90, 33, 1, 130, 72], [1, 1, 1, 130, 1], 4, 2, window=50)
    scratch = torch_paged.GatherScratch(max_elements=30 * 4 * KV_HEADS * HEAD_DIM)  # 30 blocks: 2 decodes, no prompt
    expected = paged_attention_reference(query, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(torch_paged.paged_attention_mixed(query, k_cache, v_cache, meta, SCALE, scratch),
                               expected, **EXACT)


def test_float16_cache():
    query, k_cache, v_cache, meta = make_step([40, 17, 9], [1, 17, 1], 4, 2, window=8, dtype=torch.float16)
    expected = paged_attention_reference(query, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(TorchAttentionBackend().forward(query, k_cache, v_cache, meta, SCALE), expected,
                               atol=1e-3, rtol=1e-3)


def test_caches_whose_blocks_are_not_contiguous():
    """A layer view whose blocks are not single runs of memory still reads the right K/V."""
    query, k_cache, v_cache, meta = make_step([30, 5], [1, 1], 4, 2)
    k_strided, v_strided = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache))
    assert not k_strided[0].is_contiguous()
    expected = paged_attention_reference(query, k_cache, v_cache, meta, SCALE)
    got = torch_paged.paged_decode_batched(query, k_strided, v_strided, meta, SCALE)
    torch.testing.assert_close(got, expected, **EXACT)


def test_window_reference_sees_the_last_window_positions():
    """The reference's window, checked by hand: the query at position p sees exactly p - w + 1 .. p."""
    window, context_len = 5, 12
    query, k_cache, v_cache, meta = make_step([context_len], [context_len], 4, 1, window=window)
    out = paged_attention_reference(query, k_cache, v_cache, meta, SCALE)
    k = gather_sequence_kv(k_cache, meta.block_tables[0], context_len)
    v = gather_sequence_kv(v_cache, meta.block_tables[0], context_len)
    for p in range(context_len):
        seen = slice(max(0, p - window + 1), p + 1)
        weights = (torch.einsum("hd,khd->hk", query[p], k[seen]) * SCALE).softmax(-1)
        torch.testing.assert_close(out[p], torch.einsum("hk,khd->hd", weights, v[seen]), **EXACT)


def test_window_of_the_whole_context_is_full_attention():
    query, k_cache, v_cache, meta = make_step([33, 20], [33, 4], 16, 2, window=33)
    full = dataclasses.replace(meta, sliding_window=None)
    torch.testing.assert_close(paged_attention_reference(query, k_cache, v_cache, meta, SCALE),
                               paged_attention_reference(query, k_cache, v_cache, full, SCALE), atol=0, rtol=0)


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="sliding_window"):
        make_step([4], [4], 4, 1, window=0)


def test_copy_blocks_matches_indexing():
    pool = torch.randn(8, 2, 2, 4, KV_HEADS, HEAD_DIM)
    expected = pool.clone()
    src, dst = [1, 1, 4], [0, 6, 7]
    expected[dst] = expected[src]
    backend = TorchAttentionBackend()
    backend.copy_blocks(pool, src, dst)
    torch.testing.assert_close(pool, expected, atol=0, rtol=0)
    backend.copy_blocks(pool, [], [])
    torch.testing.assert_close(pool, expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="destination"):
        backend.copy_blocks(pool, [1, 2], [3])


TINY_MODEL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=16, max_position_embeddings=512)


def test_cpu_decode_bench_compares_the_same_step():
    """The bench times the torch backend against the reference: both must compute the same logits."""
    model, pool, (token_ids, positions, meta, rows) = bench_kernels.torch_decode_case(TINY_MODEL, 4, (20, 40))
    logits = [model(token_ids, positions, pool, meta, backend, rows)
              for backend in (TorchAttentionBackend(), bench_kernels.ReferenceBackend())]
    torch.testing.assert_close(logits[0], logits[1], **EXACT)
    table = bench_kernels.run_torch_decode_bench(TINY_MODEL, batch=4, contexts=(20, 40), steps=1)
    assert [row["attention"] for row in table] == ["torch backend", "paged_attention_reference"]
    assert all(0 < row["attention ms/step"] < row["forward ms/step"] for row in table)


def test_roofline_counts_the_step_it_times():
    from kvlib.cli.bench import roofline
    from kvlib.model.config import ModelConfig
    config = ModelConfig(**TINY_MODEL)
    per_token = 2 * (2 * (64 * (6 + 2 * 2) * 16 + 6 * 16 * 64 + 3 * 64 * 128) + 64 * 96)
    assert roofline.decode_step_flops(config, [10, 20]) == 2 * per_token + 2 * 2 * 2 * 6 * 16 * 30
    runner = roofline.decode_plan(TINY_MODEL, 1, (20, 40))[0]
    weights = 2 * (64 * (6 + 2 * 2) * 16 + 6 * 16 * 64 + 3 * 64 * 128) + 96 * 64  # every projection, the head
    kv_per_token = runner.device_pool.spec.bytes_per_token
    assert kv_per_token == 4 * 2 * 2 * 2 * 16  # float32 K and V, 2 layers, 2 kv heads of 16
    assert roofline.decode_step_bytes(runner.model, [10, 20], kv_per_token) == 4 * weights + kv_per_token * 30
    row, = roofline.run_roofline(TINY_MODEL, batch=3, contexts=(20, 40), steps=1)
    assert row["step ms, best"] <= row["step ms, median"]
    assert row["% of matmul rate, best"] == pytest.approx(100 * row["step GFLOPS, best"] / row["matmul GFLOPS (32x576x1536)"])


def test_step_anatomy_puts_the_projections_back_and_adds_up(monkeypatch):
    """The stand-ins return zeros of the right shape, every projection is back after the split, and the rest is
    what the whole step leaves."""
    from kvlib.cli.bench import roofline
    built, real_plan = [], roofline.decode_plan

    def decode_plan(*args, **kwargs):
        runner, plan, lens = real_plan(*args, **kwargs)
        built.append((runner, [getattr(owner, attr) for owner, attr in roofline.projections(runner.model)], lens))
        return runner, plan, lens
    monkeypatch.setattr(roofline, "decode_plan", decode_plan)
    rows = roofline.step_anatomy(TINY_MODEL, batches=(1, 3), contexts=(20, 40), steps=1, gbps=10.0, gflops=50.0)

    assert [row["batch"] for row in rows] == [1, 3]
    for row, (runner, _, lens) in zip(rows, built):
        assert row["rest ms"] == pytest.approx(row["step ms"] - row["projections and head alone ms"]
                                               - row["step without them ms"])
        reads = roofline.decode_step_bytes(runner.model, lens, runner.device_pool.spec.bytes_per_token) / 10e9
        works = roofline.decode_step_flops(runner.model.config, lens) / 50e9
        assert row["roofline ms"] == pytest.approx(1e3 * max(reads, works))
        assert row["step / roofline"] == pytest.approx(row["step ms"] / row["roofline ms"])
    for runner, modules, _ in built:
        assert len(modules) == 4 * TINY_MODEL["num_layers"] + 1 and modules[-1] is runner.model.lm_head
        assert [getattr(owner, attr) for owner, attr in roofline.projections(runner.model)] == modules
    stand_in = roofline.ZeroProjection(modules[0].out_features)
    assert torch.equal(stand_in(torch.ones(3, modules[0].in_features)), torch.zeros(3, modules[0].out_features))


@settings(max_examples=60, deadline=None)
@given(steps(decode_only=True))
def test_in_place_decode_matches_reference(step):
    query, k_cache, v_cache, meta = make_step(**step)
    expected = paged_attention_reference(query, k_cache, v_cache, meta, SCALE)
    got = torch_paged.paged_decode_in_place(query, k_cache, v_cache, meta, SCALE)
    assert got is not None, "the engine's pool layout reads in place"
    torch.testing.assert_close(got, expected, **EXACT)


def test_decode_copies_no_kv_out_of_the_pool(monkeypatch):
    """On the engine's float32 pool the backend's decode, alone and inside a step with prefills, never gathers K/V."""
    query, k_cache, v_cache, meta = make_step([90, 33, 1, 130, 72], [1, 1, 1, 130, 1], 4, 2, window=50)
    expected = paged_attention_reference(query, k_cache, v_cache, meta, SCALE)
    decode_only = make_step([90, 33, 1, 72], [1, 1, 1, 1], 4, 2, window=50)
    decode_expected = paged_attention_reference(*decode_only, SCALE)
    gathered = []
    real_read_blocks = torch_paged.read_blocks
    monkeypatch.setattr(torch_paged, "read_blocks", lambda cache, ids, *a: gathered.append(len(ids)) or
                        real_read_blocks(cache, ids, *a))
    torch.testing.assert_close(TorchAttentionBackend().forward(*decode_only, SCALE), decode_expected, **EXACT)
    assert gathered == []
    got = TorchAttentionBackend().forward(query, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(got, expected, **EXACT)
    assert len(gathered) == 2, "only the prompt's K and V are gathered"


def test_every_layer_views_the_same_rows_up_to_its_last_block():
    """K and V of every layer are matrices of the same rows (one sparse pattern serves them all), and each ends
    exactly at its last block's last token's last kv head: nothing a block table can name is cut off."""
    from kvlib.runner.kv_cache import KVCachePool, KVCacheSpec
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    pool = KVCachePool(spec, 5, "cpu")
    pool.data.copy_(torch.arange(pool.data.numel(), dtype=torch.float32).view(pool.data.shape))
    views = [torch_paged.rows_in_place(cache) for layer in range(3) for cache in pool.layer(layer)]
    assert len({view.shape for view in views}) == 1
    for layer in range(3):
        for cache, view in zip(pool.layer(layer), views[2 * layer:2 * layer + 2]):
            assert torch.equal(view[-1], cache[-1, -1, -1])
            block_rows = cache.stride(0) // 8
            assert torch.equal(view[3 * block_rows + 2 * 2 + 1], cache[3, 2, 1])  # block 3, token 2, kv head 1


def test_in_place_decode_refuses_what_it_cannot_read():
    """Blocks that are not one run of memory, or a half-precision pool: None, and the backend gathers instead."""
    query, k_cache, v_cache, meta = make_step([30, 5], [1, 1], 4, 2)
    k_strided, v_strided = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache))
    assert torch_paged.paged_decode_in_place(query, k_strided, v_strided, meta, SCALE) is None
    torch.testing.assert_close(TorchAttentionBackend().forward(query, k_strided, v_strided, meta, SCALE),
                               paged_attention_reference(query, k_cache, v_cache, meta, SCALE), **EXACT)
    half = make_step([30, 5], [1, 1], 4, 2, dtype=torch.float16)
    assert torch_paged.paged_decode_in_place(*half, SCALE) is None
