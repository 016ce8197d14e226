"""``kvlib demo``: serve a mixed workload through a deliberately small KV pool and report what happened."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

from kvlib.config import EngineConfig, SamplingParams
from kvlib.llm import LLM

TOPICS = ["The KV cache", "Paged attention", "A block table", "Preemption", "Swapping to host memory",
          "Recomputation", "Continuous batching", "Copy-on-write", "Prefix caching", "The watermark"]


@dataclass
class DemoOptions:
    num_requests: int = 24
    num_gpu_blocks: int = 48
    num_cpu_blocks: int = 96
    block_size: int = 16
    preemption_mode: str = "swap"
    max_tokens: int = 64
    seed: int = 0
    plot_path: str = "kvlib-output/demo_timeline.png"


def demo_prompts(options: DemoOptions) -> list[str]:
    """Prompts of mixed lengths: a topic sentence repeated 1 to 12 times."""
    rng = random.Random(options.seed)
    return [" ".join([f"{rng.choice(TOPICS)} is how a serving engine keeps memory busy."] * rng.randint(1, 12))
            for _ in range(options.num_requests)]


def run_demo(options: DemoOptions = DemoOptions()) -> dict:
    config = EngineConfig(block_size=options.block_size, num_gpu_blocks=options.num_gpu_blocks,
                          num_cpu_blocks=options.num_cpu_blocks, preemption_mode=options.preemption_mode)
    llm = LLM("default", config)
    prompts = demo_prompts(options)
    print(f"serving {len(prompts)} requests through a KV pool of {options.num_gpu_blocks} blocks x "
          f"{options.block_size} tokens ({options.num_gpu_blocks * options.block_size} token slots), "
          f"preemption by {options.preemption_mode}")
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=options.max_tokens, temperature=0.8, seed=options.seed),
                        progress=True)
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
        print(f"  {out.request_id}: ...{out.text[:90]!r}")
    summary = m.summary()
    print(f"\n{summary['num_generated_tokens']} tokens in {elapsed:.2f} s "
          f"({summary['num_generated_tokens'] / elapsed:.0f} tokens/s), {summary['num_steps']} steps, "
          f"peak KV use {summary['peak_gpu_blocks_used']}/{options.num_gpu_blocks} device blocks, "
          f"{summary['peak_cpu_blocks_used']}/{options.num_cpu_blocks} host blocks")
    print("\npreemption report")
    for key in ("num_preemptions", "num_preemptions_swap", "num_preemptions_recompute", "num_swap_fallbacks",
                "num_swapped_out_blocks", "num_swapped_in_blocks", "swap_bytes", "num_recomputed_tokens"):
        print(f"  {key:<28} {summary[key]}")
    print(f"  {'preemptions per request':<28} {summary['preemptions_per_finished_request']:.2f}")
    print(f"  {'worst stutter (ms)':<28} {summary['max_inter_token_latency'] * 1e3:.1f}")
    Path(options.plot_path).parent.mkdir(parents=True, exist_ok=True)
    m.plot(options.plot_path)
    print(f"\nKV usage timeline saved to {options.plot_path}")
    return summary
