"""Lab 03 checks: the learner's Triton paged decode kernel on random paged caches, then inside the engine.

The learner's piece is a launcher, ``paged_decode(query, k_cache, v_cache, block_tables, context_lens,
scale)``, that launches a Triton kernel of their own. Every call a check makes runs under a launch
log (``LaunchLog``): it must launch a ``@triton.jit`` function defined in the notebook (not in kvlib,
not in Triton), hand it the caches themselves (K and V are read in place, never gathered into a
copy) and return a tensor that kernel wrote. A launcher that computes its answer another way, in
plain torch for instance, fails every check.

The kernel checks build decode steps the way the engine passes them (the caches are strided views
of one layer of a 6-d pool, block tables are padded with 0, unused slots hold stale data) and
compare with :func:`kvlib.attention.torch_backend.paged_attention_reference`; each varies one thing
away from the plain case, so a bug costs the checks whose cases exercise it. The engine checks plug
the launcher into an attention backend that runs every decode step of the real engine with it, and
compare each call with the reference on the same inputs and the tokens with the torch backend's:
long contexts spanning many blocks and several tiles (a missing rescale shows), scores in the
hundreds (a missing max-subtraction overflows), and float16 (both, and the dtype).

The kernels run on the GPU when there is one, else on CPU tensors under the Triton interpreter,
which is slow: shapes stay small (2 kv heads, head dim 32, a few hundred tokens).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Callable

import torch

import kvlib
from kvlib.attention.metadata import AttentionMetadata
from kvlib.attention.torch_backend import TorchAttentionBackend, paged_attention_reference
from kvlib.course.grading.checks import CheckFailed, Task, expect
from kvlib.course.grading.extract import Rules
from kvlib.course.grading.results import TaskResult

# Nothing from kvlib: kvlib.kernels and the torch backend's attention are what the lab asks for.
RULES = Rules(needs=("paged_decode",), kvlib_imports={})
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


# ---- what the launcher launches ------------------------------------------------------------------
_NOT_YOURS = tuple(str(Path(module.__file__).resolve().parent) for module in (kvlib,)) + ("<frozen",)


def _kernel_classes() -> list[type]:
    """The Triton classes whose ``run`` launches a kernel: compiled, and under the interpreter."""
    from triton.runtime.jit import JITFunction
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - every Triton this course supports has an interpreter
        pass
    return [cls for cls in classes if "run" in cls.__dict__]


@dataclass
class Launch:
    name: str
    own: bool  # defined outside kvlib and Triton: the learner's own
    storages: set[int]  # untyped storages of every tensor it was handed


@dataclass
class LaunchLog:
    """While active, every Triton kernel launch in this process is recorded (the learner's code runs here)."""

    launches: list[Launch] = field(default_factory=list)
    _saved: list = field(default_factory=list)

    def __enter__(self) -> "LaunchLog":
        for cls in _kernel_classes():
            original = cls.__dict__["run"]
            self._saved.append((cls, original))
            setattr(cls, "run", self._recording(original))
        return self

    def __exit__(self, *exc) -> None:
        for cls, original in reversed(self._saved):
            setattr(cls, "run", original)
        self._saved.clear()

    def _recording(self, original):
        log = self

        def run(kernel_self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                fn = getattr(kernel_self, "fn", None)
                filename = getattr(getattr(fn, "__code__", None), "co_filename", "")
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                log.launches.append(Launch(getattr(fn, "__name__", "?"),
                                           bool(filename) and not filename.startswith(_NOT_YOURS)
                                           and "/triton/" not in filename,
                                           {t.untyped_storage().data_ptr() for t in tensors}))
            return original(kernel_self, *args, **kwargs)
        return run


def call_checked(decode: Decode, query, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    """``decode(...)``, failing the check unless a Triton kernel of the learner's computed the result in place."""
    with LaunchLog() as log:
        out = decode(query, k_cache, v_cache, block_tables, context_lens, scale)
    own = [launch for launch in log.launches if launch.own]
    expect(own, "your launcher returned without launching a Triton kernel of your own (a @triton.jit function "
                "defined in your notebook" + (f"; it launched only {', '.join(l.name for l in log.launches)}"
                                              if log.launches else "") +
                "): this lab grades a Triton kernel, so an answer computed another way scores nothing")
    caches = {k_cache.untyped_storage().data_ptr(), v_cache.untyped_storage().data_ptr()}
    expect(any(caches <= launch.storages for launch in own),
           "your kernel was never handed k_cache and v_cache themselves: read K and V in place through the block "
           "table (pass the cache tensors and their strides), not a gathered or contiguous copy")
    expect(isinstance(out, torch.Tensor) and any(out.untyped_storage().data_ptr() in launch.storages for launch in own),
           f"the launcher returned {_describe(out)} that your kernel did not write: allocate the output, pass it to "
           f"the kernel and return it")
    return out


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
        return call_checked(decode, self.query, self.k_cache, self.v_cache, self.meta.block_tables,
                            self.meta.context_lens, SCALE)

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
    _expect_like(got, want, f"with {case.label}")
    close = torch.isclose(got.float(), want.float(), **TOLERANCE[want.dtype]).all(dim=-1)  # [num_seqs, num_heads]
    if not bool(close.all()):
        seq, head = (int(i) for i in (~close).nonzero()[0])
        error = float((got.float() - want.float()).abs().max())
        expect(False, f"with {case.label}: sequence {seq} (context {case.meta.context_lens[seq].item()}), query head "
                      f"{head} differs from the reference; largest error {error:.3g}")


def _expect_like(got, want: torch.Tensor, where: str) -> None:
    expect(isinstance(got, torch.Tensor) and got.shape == want.shape,
           f"{where}: returned {_describe(got)}, expected a tensor of shape {tuple(want.shape)}")
    expect(got.dtype == want.dtype, f"{where}: returned dtype {got.dtype}, expected the query's {want.dtype}")
    expect(bool(torch.isfinite(got).all()), f"{where}: the output holds inf or NaN")


def _describe(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


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


@kernel.check(1, "when a tile raises the running maximum, what you accumulated so far was scaled for the old "
                 "maximum: rescale both the running sum and the accumulator before adding the tile's share")
def long_context(decode: Decode) -> None:
    expect_matches_reference(decode, make_case([320, 96], block_size=16, seed=30))


@kernel.check(1, "subtract the running maximum before exponentiating: exp of a score above about 88 is inf in "
                 "float32 (above about 11 in float16)")
def large_scores(decode: Decode) -> None:
    expect_matches_reference(decode, make_case([16, 8], block_size=8, query_scale=100.0, seed=40))


@kernel.check(1, "return the query's dtype; accumulate in float32, and give tl.dot operands of one dtype")
def float16(decode: Decode) -> None:
    expect_matches_reference(decode, make_case([16, 32], block_size=16, dtype=torch.float16, seed=50))


# ---- engine ------------------------------------------------------------------------------------
class LearnerDecodeBackend(TorchAttentionBackend):
    """The torch backend, except that decode-only steps run the learner's launcher.

    Every score is multiplied by ``score_factor`` (prefill and decode alike), so a check can make
    attention as sharp as it needs. Each decode call is compared with the reference on its own
    inputs, and the first one that differs fails the check (``workload`` says how to explain it).
    """

    name = "lab03"

    def __init__(self, decode: Decode, workload: "EngineWorkload"):
        super().__init__()
        self.decode = decode
        self.workload = workload
        self.num_calls = 0

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        scale = scale * self.workload.score_factor
        if not meta.is_decode_only:
            return super().forward(query, k_cache, v_cache, meta, scale)
        self.num_calls += 1
        got = call_checked(self.decode, query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        want = paged_attention_reference(query, k_cache, v_cache, meta, scale)
        where = f"{self.workload.describe()}, decode call {self.num_calls}"
        expect(isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype,
               f"{where}: your launcher returned {_describe(got)} of dtype {getattr(got, 'dtype', None)}; the "
               f"engine needs the query's shape {tuple(want.shape)} and dtype {want.dtype}")
        finite = torch.isfinite(got.float()).flatten(1).all(dim=1).tolist()
        lens = meta.context_lens.tolist()
        if not all(finite):
            broken = [n for n, ok in zip(lens, finite) if not ok]
            raise CheckFailed(f"{where}: your kernel returned inf or NaN for contexts of {_list(broken)} tokens; "
                              f"{self.workload.cause or 'look at the masked positions and the final division'}")
        close = torch.isclose(got.float(), want.float(), **TOLERANCE[want.dtype]).flatten(1).all(dim=1).tolist()
        if not all(close):
            wrong = sorted(n for n, ok in zip(lens, close) if not ok)
            right = sorted(n for n, ok in zip(lens, close) if ok)
            error = float((got.float() - want.float()).abs().max())
            why = (f"the contexts of {_list(right)} tokens matched, so the error comes with length: {GROWTH}"
                   if right and right[-1] < wrong[0] else "pass the kernel checks first: they vary one thing at a time")
            raise CheckFailed(f"{where}: the rows of contexts of {_list(wrong)} tokens differ from the reference on "
                              f"the same inputs (largest error {error:.3g}); {why}")
        return got


class ScaledTorchBackend(TorchAttentionBackend):
    """kvlib's torch backend with the same sharpened scores: what the learner's tokens are compared with."""

    def __init__(self, score_factor: float):
        super().__init__()
        self.score_factor = score_factor

    def forward(self, query, k_cache, v_cache, meta, scale):
        return super().forward(query, k_cache, v_cache, meta, scale * self.score_factor)


GROWTH = ("when a tile raises the running maximum, did you rescale both the running sum and the accumulator by "
          "exp(old maximum - new maximum)?")


@dataclass(frozen=True)
class EngineWorkload:
    name: str
    prompt_lens: tuple[int, ...]
    block_size: int
    dtype: str
    score_factor: float
    max_tokens: int = 4
    cause: str = ""  # the likely cause when the kernel returns inf or NaN here

    def describe(self) -> str:
        return (f"{self.name} ({self.dtype}, prompts of {', '.join(map(str, self.prompt_lens))} tokens in blocks of "
                f"{self.block_size})")


def _prompt(i: int, length: int) -> list[int]:
    return [(7 * i + 3 * j + 1) % 250 + 3 for j in range(length)]


LONG = EngineWorkload("long contexts", (200, 130, 9), 8, "float32", 1.0)
SHARP = EngineWorkload("large scores", (100, 9), 16, "float32", 12.0,
                       cause="every score here is multiplied by 12, so the largest pass 100, and exp of a score above "
                             "about 88 is inf in float32: did you subtract the running maximum before exponentiating?")
HALF = EngineWorkload("float16", (160, 12), 8, "float16", 1.0,
                      cause="in float16 exp overflows above about 11, and scores here reach about 17: subtract the "
                            "running maximum before exponentiating, and accumulate in float32")


def _generate(backend, workload: EngineWorkload) -> list[list[int]]:
    from kvlib import LLM, EngineConfig, SamplingParams

    config = EngineConfig(block_size=workload.block_size, num_gpu_blocks=128, device=DEVICE, dtype=workload.dtype)
    llm = LLM("default", config, attention_backend=backend, verbose=False)
    prompts = [_prompt(i, n) for i, n in enumerate(workload.prompt_lens)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True))
    return [out.token_ids for out in outs]


@cache
def _reference_tokens(workload: EngineWorkload) -> tuple:
    return tuple(map(tuple, _generate(ScaledTorchBackend(workload.score_factor), workload)))


def expect_engine_matches(decode: Decode, workload: EngineWorkload) -> None:
    """Every decode call matches the reference on its inputs, and the tokens match the torch backend's."""
    backend = LearnerDecodeBackend(decode, workload)
    tokens = _generate(backend, workload)
    expect(backend.num_calls > 0, "the engine never called the launcher: no decode-only step ran")
    for i, (mine, reference) in enumerate(zip(tokens, _reference_tokens(workload))):
        expect(mine == list(reference), f"{workload.describe()}: prompt {i} generated {mine} with your kernel but "
                                        f"{list(reference)} with the torch backend")


def _list(values: list[int]) -> str:
    values = sorted(set(values))
    return ", ".join(map(str, values[:-1])) + (" and " if len(values) > 1 else "") + str(values[-1])


@engine.check(3, "pass the kernel checks first; the engine calls your launcher for every decode step of every "
                 "layer, with contexts of up to 203 tokens in blocks of 8 (dozens of blocks, several tiles)")
def long_contexts(decode: Decode) -> None:
    expect_engine_matches(decode, LONG)


@engine.check(2, "scores in the hundreds: subtract the running maximum before exponentiating, or exp overflows")
def large_scores_in_the_engine(decode: Decode) -> None:
    expect_engine_matches(decode, SHARP)


@engine.check(2, "the engine in float16: return the query's dtype, accumulate in float32, subtract the running "
                 "maximum and rescale, since float16 overflows and rounds sooner")
def float16_engine(decode: Decode) -> None:
    expect_engine_matches(decode, HALF)
