"""Lab 03 checks: the learner's paged decode kernel on random paged caches, then inside the engine.

The learner's piece is a launcher with the arguments of :func:`kvlib.kernels.paged_decode_attention`:
``decode(query, k_cache, v_cache, block_tables, context_lens, scale)``. Each kernel check builds
decode steps the way the engine passes them (the caches are strided views of one layer of a 6-d
pool, block tables are padded with 0, unused slots hold stale data) and compares the output with
:func:`kvlib.attention.torch_backend.paged_attention_reference`. Every check varies one thing
away from the plain case, so a bug costs the checks whose cases exercise it. The engine check
plugs the launcher into a torch backend for decode-only steps and compares greedy tokens.

The kernels run on the GPU when there is one, else on CPU tensors under the Triton interpreter,
which is slow: shapes stay tiny (2 kv heads, head dim 32, at most a few hundred tokens).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import Callable

import torch

from kvlib.attention.metadata import AttentionMetadata
from kvlib.attention.torch_backend import TorchAttentionBackend, paged_attention_reference
from kvlib.course.grading.checks import Task, expect
from kvlib.course.grading.extract import Rules
from kvlib.course.grading.results import TaskResult

RULES = Rules(needs=('paged_decode',), kvlib_imports={'kvlib.attention': {'*'}, 'kvlib.attention.metadata': {'AttentionMetadata'}}, own_methods=())
kernel = Task("kernel", RULES)
engine = Task("engine", RULES)
TASKS = [kernel, engine]

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
KV_HEADS = 2
HEAD_DIM = 32
NUM_LAYERS = 2
LAYER = 1  # not layer 0, so the views start at an offset into the pool
SCALE = HEAD_DIM ** -0.5
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3)}

Decode = Callable[..., torch.Tensor]


def check_kernel(decode: Decode) -> TaskResult:
    return kernel.grade(decode)


def check_engine(decode: Decode) -> TaskResult:
    return engine.grade(decode)


# ---- random decode steps -----------------------------------------------------------------------
@dataclass
class DecodeCase:
    """One decode step over a random paged cache: what the kernel gets, and a description for messages."""

    query: torch.Tensor  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim], a strided view
    v_cache: torch.Tensor
    meta: AttentionMetadata
    label: str

    def run(self, decode: Decode) -> torch.Tensor:
        return decode(self.query, self.k_cache, self.v_cache, self.meta.block_tables, self.meta.context_lens, SCALE)

    def expected(self) -> torch.Tensor:
        return paged_attention_reference(self.query, self.k_cache, self.v_cache, self.meta, SCALE)


def make_case(context_lens: list[int], block_size: int, group: int = 1, *, dtype=torch.float32, shuffle=True,
              query_scale: float = 1.0, seed: int = 0) -> DecodeCase:
    """A decode step of ``len(context_lens)`` sequences; every slot of the pool holds random data.

    With ``shuffle`` the sequences' blocks are a random permutation of the pool, else sequence
    blocks run 0, 1, 2, ... in order. Tables are padded with 0, as the engine pads them.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + (2 if shuffle else 0)
    ids = (torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)).tolist()
    tables = torch.zeros(len(context_lens), max(needed) + 1, dtype=torch.int32)
    for i, count in enumerate(needed):
        tables[i, :count] = torch.tensor(ids[:count])
        ids = ids[count:]
    pool = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, KV_HEADS, HEAD_DIM, generator=gen)
    pool = pool.to(dtype=dtype, device=DEVICE)
    query = torch.randn(len(context_lens), KV_HEADS * group, HEAD_DIM, generator=gen) * query_scale
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=DEVICE), block_tables=tables.to(DEVICE),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        query_start=torch.arange(len(context_lens) + 1, dtype=torch.int32, device=DEVICE),
        max_query_len=1, max_context_len=max(context_lens))
    label = (f"context_lens={context_lens}, block_size={block_size}, {KV_HEADS * group} query heads over "
             f"{KV_HEADS} kv heads, {str(dtype).removeprefix('torch.')}")
    return DecodeCase(query.to(dtype=dtype, device=DEVICE), pool[:, LAYER, 0], pool[:, LAYER, 1], meta, label)


def expect_matches_reference(decode: Decode, case: DecodeCase) -> None:
    """The learner's output must have the query's shape and dtype and match the reference."""
    got = case.run(decode)
    want = case.expected()
    expect(isinstance(got, torch.Tensor) and got.shape == want.shape,
           f"with {case.label}: returned {_describe(got)}, expected a tensor of shape {tuple(want.shape)}")
    expect(got.dtype == want.dtype, f"with {case.label}: returned dtype {got.dtype}, expected the query's {want.dtype}")
    expect(bool(torch.isfinite(got).all()), f"with {case.label}: the output holds inf or NaN")
    close = torch.isclose(got.float(), want.float(), **TOLERANCE[want.dtype]).all(dim=-1)  # [num_seqs, num_heads]
    if not bool(close.all()):
        seq, head = (int(i) for i in (~close).nonzero()[0])
        error = float((got.float() - want.float()).abs().max())
        expect(False, f"with {case.label}: sequence {seq} (context {case.meta.context_lens[seq].item()}), query head "
                      f"{head} differs from the reference; largest error {error:.3g}")


def _describe(value) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


# ---- kernel --------------------------------------------------------------------------------------
@kernel.check(1, "one program per (sequence, kv head): load the query rows, loop over the context in tiles, "
                 "gather K and V through the block table, keep a running softmax, divide by its sum at the end")
def one_sequence(decode: Decode) -> None:
    expect_matches_reference(decode, make_case([16], block_size=4, shuffle=False))


@kernel.check(2, "position p lives in block block_tables[seq, p // block_size] at offset p % block_size: "
                 "load the block id from the sequence's own row of the table, never assume blocks are in order")
def shuffled_block_tables(decode: Decode) -> None:
    for seed, (lens, block_size) in enumerate([([8, 32, 12], 4), ([16, 48], 16), ([3, 7, 1], 1)]):
        expect_matches_reference(decode, make_case(lens, block_size, seed=seed))


@kernel.check(2, "mask every position >= context_len (scores to -inf, K/V loads masked): the last block's "
                 "unused slots hold stale data and padded table entries point at block 0")
def lengths_mid_block(decode: Decode) -> None:
    for seed, (lens, block_size) in enumerate([([5, 18, 33, 1], 4), ([17, 40], 16)]):
        expect_matches_reference(decode, make_case(lens, block_size, seed=10 + seed))


@kernel.check(2, "query head h reads kv head h // group, where group = num_heads // num_kv_heads: the heads "
                 "of one group are consecutive")
def gqa_groups(decode: Decode) -> None:
    for seed, (lens, block_size, group) in enumerate([([8, 20], 4, 2), ([12, 4], 4, 4), ([16], 16, 8)]):
        expect_matches_reference(decode, make_case(lens, block_size, group, seed=20 + seed))


@kernel.check(1, "when a tile raises the running max from m to m_new, multiply both the running sum and the "
                 "accumulator by exp(m - m_new) before adding the tile's share")
def long_context(decode: Decode) -> None:
    expect_matches_reference(decode, make_case([320, 96], block_size=16, seed=30))


@kernel.check(1, "subtract the running max before exponentiating: exp of a score above about 88 is inf in "
                 "float32 (above about 11 in float16)")
def large_scores(decode: Decode) -> None:
    expect_matches_reference(decode, make_case([16, 8], block_size=8, query_scale=100.0, seed=40))


@kernel.check(1, "return the query's dtype; accumulate in float32, and cast p to V's dtype before tl.dot")
def float16(decode: Decode) -> None:
    expect_matches_reference(decode, make_case([16, 32], block_size=16, dtype=torch.float16, seed=50))


# ---- engine ------------------------------------------------------------------------------------
class LearnerDecodeBackend(TorchAttentionBackend):
    """The torch backend, except that decode-only steps run the learner's launcher."""

    name = "lab03"

    def __init__(self, decode: Decode):
        super().__init__()
        self.decode = decode
        self.num_decode_calls = 0

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not meta.is_decode_only:
            return super().forward(query, k_cache, v_cache, meta, scale)
        self.num_decode_calls += 1
        return self.decode(query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)


# Prompt lengths end mid-block, so decode reads partially filled last blocks.
ENGINE_PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7], [1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5]]
MAX_TOKENS = 5


@engine.check(5, "pass the kernel checks first; the engine calls your launcher for every decode step, each "
                 "layer's caches being a strided view of the pool")
def same_tokens_as_torch(decode: Decode) -> None:
    backend = LearnerDecodeBackend(decode)
    tokens = _generate(backend)
    expect(backend.num_decode_calls > 0, "the engine never called the launcher: no decode-only step ran")
    for i, (mine, reference) in enumerate(zip(tokens, _reference_tokens())):
        expect(mine == reference, f"prompt {i} ({len(ENGINE_PROMPTS[i])} tokens) generated {mine} with your kernel "
                                  f"but {reference} with the torch backend")


@cache
def _reference_tokens() -> tuple:
    return tuple(_generate(TorchAttentionBackend()))


def _generate(backend) -> list[list[int]]:
    from kvlib import LLM, EngineConfig, SamplingParams

    config = EngineConfig(block_size=4, num_gpu_blocks=32, device=DEVICE, dtype="float32")
    llm = LLM("default", config, attention_backend=backend, verbose=False)
    outs = llm.generate(ENGINE_PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return [out.token_ids for out in outs]
