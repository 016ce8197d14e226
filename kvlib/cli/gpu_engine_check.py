"""The GPU check's engine part: each check on its own, so one that fails (transformers missing, say) loses
only its own figure.

Greedy tokens of the Triton engine against the torch engine and against transformers, all in
float32 on the GPU, plain, under swap with the host prefix tier, and seeded samples with n = 3
(copy-on-write); bfloat16 agreement between the backends; the pool the memory profile sizes;
device synchronizations per decode step, plain and with copy-on-write steps (one is reading the
sampled tokens back); the swap time the events measured against the steps' wall time.
"""
from __future__ import annotations

import time
import warnings

import torch

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.runner.decode_graphs import graph_safe

PROMPTS = ["The with statement", "A dictionary is a mapping", "Exceptions are raised when", "import os",
           "The for loop iterates over the items of any sequence"]
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=16, n=3, temperature=1.0, seed=7)


def engine(backend: str, dtype: str = "float32", **config) -> LLM:
    return LLM("default", EngineConfig(attention_backend=backend, dtype=dtype, **{"num_gpu_blocks": 512, **config}),
               verbose=False)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def transformers_tokens() -> list[list[int]]:
    from kvlib.cli.gpu_real_parts import transformers_greedy
    from kvlib.model.default import default_model_path
    from kvlib.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(default_model_path())
    return transformers_greedy(default_model_path(), [tok.encode(p) for p in PROMPTS], torch.float32,
                               GREEDY.max_tokens)


def synchronizations_per_step(llm: LLM, params: SamplingParams) -> tuple[int, int, int]:
    """Decode steps, synchronizing calls during them and copy-on-write copies, serving ``PROMPTS`` with ``params``."""
    engine, steps = llm.engine, 0
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"sync-{i}-{params.n}", prompt, params)
    engine.step()  # the prefill
    copies = llm.metrics.num_cow_copies
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return steps, len(caught), llm.metrics.num_cow_copies - copies


def run_engine_checks(out) -> bool:
    """Each check records its figure, or its error; True when every one ran and agreed."""
    ok = True

    def check(name: str, measure) -> None:
        nonlocal ok
        try:
            passed = measure()
            ok &= passed is not False
        except Exception as error:  # noqa: BLE001 - one check failing must not lose the others
            ok = False
            out.error(name, error)

    tokens: dict[str, list] = {}

    def backends_agree() -> bool:
        for backend in ("triton", "torch"):
            llm = engine(backend)
            tokens[backend] = greedy_tokens(llm)
            captured = llm.engine.runner.graphs is not None
            if graph_safe(llm.engine.runner.backend):  # a target only where the backend says it can be replayed
                out.add(f"float32 {backend}: decode graphs captured", captured, "bool")
            else:
                out.add(f"float32 {backend}: decode graphs", "not captured: the backend declares itself not "
                        "graph-safe", "fact", captured=captured)
        out.add("float32 greedy tokens equal across backends", tokens["triton"] == tokens["torch"], "bool")
        return tokens["triton"] == tokens["torch"]
    check("backends", backends_agree)

    def matches_transformers() -> bool:
        expected = transformers_tokens()
        same = tokens.get("triton") == expected
        out.add("float32 triton greedy tokens equal transformers", same, "bool")
        return same
    check("transformers", matches_transformers)

    def under_swap() -> bool:
        llm = engine("triton", num_gpu_blocks=12, num_cpu_blocks=64, preemption_mode="swap", watermark=0.0,
                     enable_prefix_caching=True, host_prefix_cache=True)
        start = time.perf_counter()
        got = greedy_tokens(llm)
        wall, m = time.perf_counter() - start, llm.metrics
        same = got == tokens.get("torch")
        out.add("greedy tokens under swap and the host prefix tier equal the torch engine's", same, "bool",
                preemptions=m.num_preemptions, blocks_out=m.num_swapped_out_blocks, blocks_in=m.num_swapped_in_blocks)
        out.add("swap time from events", m.swap_time, "s", wall_seconds=wall, swap_bytes=m.swap_bytes,
                gbps=m.swap_bytes / m.swap_time / 1e9 if m.swap_time else None,
                pinned_bytes=llm.engine.runner.host_pool.pinned_bytes, pool_bytes=llm.engine.runner.host_pool.data.nbytes)
        return same and m.num_swapped_out_blocks > 0 and 0 < m.swap_time < wall
    check("swap", under_swap)

    def seeded_samples() -> bool:
        runs = [[[s.token_ids for s in o.samples] for o in engine(b).generate(PROMPTS, SAMPLED)]
                for b in ("triton", "torch")]
        out.add("seeded samples (n = 3, copy-on-write) equal across backends", runs[0] == runs[1], "bool")
        return runs[0] == runs[1]
    check("samples", seeded_samples)

    def bfloat16() -> None:
        runs = [greedy_tokens(engine(b, "bfloat16")) for b in ("triton", "torch")]
        same = sum(a == b for x, y in zip(*runs) for a, b in zip(x, y))
        out.add("bfloat16 greedy tokens equal across backends", same / sum(map(len, runs[0])), "share of tokens")
    check("bfloat16", bfloat16)

    def profiled_pool_and_synchronizations() -> bool:
        llm = LLM("default", EngineConfig(gpu_memory_utilization=0.3), verbose=False)
        pool = llm.engine.runner.device_pool
        out.add("pool sized by the memory profile", pool.num_blocks, "blocks", gib=pool.data.nbytes / 2**30,
                dtype=str(llm.engine.dtype))
        llm.generate(PROMPTS, SamplingParams(max_tokens=2))
        fine = True
        for label, params in (("greedy", GREEDY), ("n = 3 with copy-on-write", SAMPLED)):
            steps, syncs, copies = synchronizations_per_step(llm, params)
            out.add(f"synchronizations per decode step, {label}", syncs / max(steps, 1), "per step", steps=steps,
                    synchronizing_calls=syncs, cow_copies=copies)
            fine &= syncs <= steps
        return fine
    check("synchronizations", profiled_pool_and_synchronizations)
    return ok
