"""The GPU check's parts at real model shapes: random-weight checkpoints of Llama-3.2-1B's and Llama-3-8B's
shapes (:mod:`kvlib.cli.gpu_shapes`), written on the device, then measured as a learner's GPU would run them.

- ``real-tokens``: greedy tokens of kvlib's Triton engine against transformers on the same 1B-shaped
  weights, in float32 (equal, or a bug) and in bfloat16 (the share that agrees, for the record);
- ``crossover``: victims from 16 to 16,384 tokens preempted both ways for real, alone and beside a
  decode batch, per shape: the seed lesson's "moderate prompts favour recomputation, very long
  contexts favour swapping" as measured numbers, kept as runs lessons 07 and 09 show; beside the
  batch, each victim carries the spread of identical decode passes, and a cost within it decides nothing;
- ``real-engine``: kvlib (decode graphs on and off) against transformers' strongest batching at the
  same KV slots and dtype on a ShareGPT-like mix: output tok/s, TTFT and inter-token p50/p99;
- ``preemption``: one oversubscribed workload through recompute, swap, auto and partial preemption
  against a pool that holds it all.

Each figure is written as soon as it is measured, so a part cut by its timeout keeps what it had.
"""
from __future__ import annotations

import datetime
import gc
import random
import time
from dataclasses import asdict

import torch

from kvlib.cli.gpu_shapes import SHAPES, shape_folder

REAL_SHAPES = ("llama-3.2-1b", "llama-3.1-8b")
TOKENS_SHAPE = "llama-3.2-1b"
TOKEN_PROMPT_LENGTHS = (7, 33, 120, 400)
TOKEN_STEPS = 24
VICTIM_LENGTHS = [16, 64, 256, 1024, 4096, 16384]
RETURNING_CONTEXTS = [256, 1024, 4096, 16384]
NEW_TOKENS = 40  # a returning turn's reply and new text, as in lesson 09
BESIDE_BATCH, BESIDE_CONTEXT = 32, 1024  # the decode batch a victim is priced beside
ENGINE_REQUESTS, ENGINE_SCALE, ENGINE_RATE, ENGINE_SLOTS = 32, 0.5, 200.0, 8192
# transformers' static batching is tuned over this many of its largest row caps (the largest: as many rows as the
# slots hold); each cap tried is a whole pass, up to a minute of the device's time at 8B
STATIC_ROW_CAPS = 1
PREEMPTION_REQUESTS, PREEMPTION_SHARE = 48, 3  # the tight pool holds a third of what the requests need at once
PREEMPTION_MODES = [("recompute", False), ("swap", False), ("auto", False), ("auto", True)]


def release() -> None:
    """Give the last engine's device memory back before the next one loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def part_shapes(out) -> bool:
    """Write every real-shape checkpoint (each part writes its own where it is missing; this times them)."""
    for name in REAL_SHAPES:
        start = time.perf_counter()
        folder = shape_folder(name)
        size = sum(f.stat().st_size for f in folder.iterdir())
        out.add("checkpoint written", time.perf_counter() - start, "s", shape=name,
                parameters=SHAPES[name].parameters, gib=size / 2**30)
    return True


def token_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in TOKEN_PROMPT_LENGTHS]


def kvlib_greedy(folder, prompts: list[list[int]], dtype: str) -> list[list[int]]:
    from kvlib import LLM, EngineConfig, SamplingParams
    llm = LLM(folder, EngineConfig(dtype=dtype, num_gpu_blocks=256, attention_backend="auto"), verbose=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=TOKEN_STEPS, ignore_eos=True))
    del llm
    release()
    return [o.token_ids for o in outs]


def transformers_greedy(folder, prompts: list[list[int]], dtype: torch.dtype,
                        steps: int | None = None) -> list[list[int]]:
    """transformers' own greedy tokens, ``steps`` (``TOKEN_STEPS`` when None) for each prompt, no end of sequence,
    on the GPU where there is one (kvlib's ``device="auto"``)."""
    from kvlib.cli.bench.engine_baselines import load_transformers
    from kvlib.cli.bench.engine_workload import Placement
    from kvlib.runner.device import resolve_device
    device = resolve_device("auto")
    model = load_transformers(folder, Placement(device, dtype))
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps or TOKEN_STEPS,
                                 do_sample=False, pad_token_id=0)
            expected.append(got[0, len(prompt):].tolist())
    del model
    release()
    return expected


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """Tokens two greedy runs share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def part_real_tokens(out) -> bool:
    """Greedy tokens on the 1B-shaped weights: float32 must equal transformers'; bfloat16 is recorded."""
    folder = shape_folder(TOKENS_SHAPE)
    prompts = token_prompts(SHAPES[TOKENS_SHAPE].vocab_size)
    equal = True
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        got, expected = kvlib_greedy(folder, prompts, name), transformers_greedy(folder, prompts, dtype)
        shared = [agreeing_prefix(a, b) for a, b in zip(got, expected)]
        if dtype == torch.float32:
            equal = got == expected
            out.add(f"{TOKENS_SHAPE}-shaped float32 greedy tokens equal transformers", equal, "bool",
                    prompts=list(TOKEN_PROMPT_LENGTHS), steps=TOKEN_STEPS, agreeing_prefix=shared)
        else:
            out.add(f"{TOKENS_SHAPE}-shaped bfloat16 greedy tokens before the first difference from transformers",
                    sum(shared) / (len(prompts) * TOKEN_STEPS), "share of tokens", agreeing_prefix=shared)
    return equal


def measured_runs_for(shape: str, runner, cost_model, dtype: torch.dtype, victim_lengths=VICTIM_LENGTHS,
                      contexts=RETURNING_CONTEXTS, beside=(BESIDE_BATCH, BESIDE_CONTEXT)) -> list:
    """Two runs in ``runner``'s pools: victims both ways alone, then beside a decode batch of ``beside`` (sequences,
    cached tokens each), both with the returning turns of ``contexts``."""
    from kvlib.course.measured_runs import MeasuredRun, device_name
    from kvlib.runner.cost_probe import time_returning_turns, time_victims
    returning = time_returning_turns(runner, list(contexts), NEW_TOKENS)
    runs = []
    for batch, context in ((0, 0), beside):
        victims = time_victims(runner, list(victim_lengths), batch=batch, batch_context=context, swap_beside=batch > 0)
        where = "alone" if not batch else f"beside {batch} decodes of {context:,} tokens"
        runs.append(MeasuredRun(
            name=f"{device_name(runner.device)}, {shape}-shaped, victims {where}",
            date=datetime.date.today().isoformat(), device=device_name(runner.device),
            model=f"{shape}-shaped (random {str(dtype).removeprefix('torch.')} weights)",
            dtype=str(dtype).removeprefix("torch."), block_size=runner.spec.block_size,
            block_bytes=runner.spec.block_bytes, threads=torch.get_num_threads(), torch_version=torch.__version__,
            cost_model=cost_model, batch=batch, victims=victims, new_tokens=NEW_TOKENS, returning=returning))
    return runs


def part_crossover(out) -> bool:
    """Per shape: the engine's cost model as auto mode measures it, then victims and returning turns both ways."""
    from kvlib import LLM, EngineConfig
    from kvlib.course.measured_runs import crossover
    for shape in REAL_SHAPES:
        longest = max(VICTIM_LENGTHS + RETURNING_CONTEXTS) + NEW_TOKENS
        blocks = 2 * -(-longest // 16) + 64
        llm = LLM(shape_folder(shape), EngineConfig(block_size=16, num_gpu_blocks=blocks, num_cpu_blocks=blocks,
                                                     preemption_mode="auto"), verbose=False)
        engine = llm.engine
        for run in measured_runs_for(shape, engine.runner, engine.cost_model, engine.dtype, VICTIM_LENGTHS,
                                     RETURNING_CONTEXTS, (BESIDE_BATCH, BESIDE_CONTEXT)):
            out.write({"kind": "measured_run", "part": out.part, "run": asdict(run)})
            out.add("swap beats recompute from", crossover(run), "tokens", shape=shape, batch=run.batch,
                    victims=[asdict(v) for v in run.victims])
        del llm, engine
        release()
    return True


def part_real_engine(out) -> bool:
    """Per shape: kvlib with and without decode graphs against transformers' strongest batching."""
    from kvlib.cli.bench.engine import compare, row_caps
    from kvlib.cli.bench.engine_workload import make_workload
    for shape in REAL_SHAPES:
        requests = make_workload(ENGINE_REQUESTS, ENGINE_SCALE, ENGINE_RATE, SHAPES[shape].vocab_size)
        start = time.perf_counter()

        def served(stage: str, name: str, row: dict) -> None:
            if stage == "warm-up":  # a few requests of a few tokens: no figure (its progress record shows it ran)
                return
            out.add("engine output tokens/s", row["output tokens/s"], "output tokens/s", shape=shape, engine=name,
                    stage=stage, seconds_into_part=time.perf_counter() - start, requests=len(requests),
                    **{key: row.get(key) for key in ("TTFT p50 s", "TTFT p99 s", "ITL p50 s", "ITL p99 s", "ITL note",
                                                     "E2E p50 s", "KV slots", "KV slots note", "dtype",
                                                     "preemptions")})
        report = compare(shape_folder(shape), requests, ENGINE_SLOTS, 16, rounds=1, caches=("dynamic",),
                         compare_graphs=True, static_rows=row_caps(requests, ENGINE_SLOTS)[-STATIC_ROW_CAPS:],
                         served=served, progress=lambda step: out.progress(
                             step, shape=shape, seconds_into_part=round(time.perf_counter() - start, 2)))
        out.add("engine greedy agreement", report["agree"], "requests equal to kvlib's", shape=shape)
        strongest = report["paired"][report["strongest"]]["median"]
        out.add("engine", strongest, "x transformers' strongest", shape=shape, strongest=report["strongest"],
                slots=report["slots"], tuning=report["tuning"])
        speeds = {name: runs[0]["output tokens/s"] for name, runs in report["runs"].items()}
        graphs_on = speeds[report["kvlib"]]
        graphs_off = next((v for k, v in speeds.items() if k.startswith("kvlib") and k != report["kvlib"]), None)
        if graphs_off:
            out.add("decode graphs", graphs_on / graphs_off, "x kvlib without graphs", shape=shape,
                    with_graphs=graphs_on, without_graphs=graphs_off)
        del report
        release()
    return True


def part_preemption(out) -> bool:
    """The 1B shape under a pool that holds a third of the load, every mode, against one that holds it all; each
    mode's row written as its run ends."""
    from kvlib.cli.bench.preemption import blocks_needed, oversubscribed_workload, preemption_rows
    shape = REAL_SHAPES[0]
    vocab = range(3, SHAPES[shape].vocab_size)
    prompts, params = oversubscribed_workload(PREEMPTION_REQUESTS, 1, 0, vocab)
    need = blocks_needed(prompts, params, 16)
    roomy = None
    for row in preemption_rows(PREEMPTION_REQUESTS, 1, need // PREEMPTION_SHARE, need, 16, 0, PREEMPTION_MODES,
                               shape_folder(shape), vocab):
        if roomy is None:  # the first row: the pool that holds it all
            roomy = row["tokens/s"]
        out.add("preemption under load", row["tokens/s"] / roomy, "x the roomy pool's tokens/s", shape=shape,
                blocks_needed=need, **{k.replace(" ", "_").replace("/", "_per_"): v for k, v in row.items()})
    return True


PARTS = {"shapes": part_shapes, "real-tokens": part_real_tokens, "crossover": part_crossover,
         "real-engine": part_real_engine, "preemption": part_preemption}
