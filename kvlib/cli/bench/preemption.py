"""``kvlib bench preemption``: one oversubscribed workload served in every preemption mode, side by side.

- Workload: ShareGPT-like lengths (``kvlib.cli.bench.workloads``) divided by ``scale`` so that it runs
  on a CPU, random prompt tokens, greedy decoding with ``ignore_eos`` so that every request
  generates exactly its drawn output length. All requests arrive at once.
- The first row serves it on the default model in a device pool big enough for every request
  at once: no preemption. Its outputs are the reference every other row must reproduce
  (``outputs identical``), and its throughput is what preemption is paid against.
- Every other row serves the same requests in a pool of ``num_gpu_blocks``, a fraction of what
  they need together, so the engine must preempt: recompute, swap or auto (the engine's
  measured cost model picks per victim), each whole-request and partial.
- Latencies are per request from arrival: TTFT p50 and p99, and the worst stutter, the longest
  gap between two consecutive tokens of any request. ``warned``: the engine's oversubscription
  detector (``kvlib.core.oversubscription``) fired during the run. ``swap ms`` and ``recompute ms`` are
  the engine's own accounting of time spent copying blocks and re-prefilling dropped tokens.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import random
import time
from typing import Iterator, Optional

import torch

from kvlib.cli.bench.report import format_table
from kvlib.cli.bench.workloads import sharegpt_like_lengths
from kvlib.config import EngineConfig, SamplingParams
from kvlib.core.block_table import blocks_for
from kvlib.course.progress import TokenProgress, counting, tokens_of
from kvlib.llm import LLM

MODES = [("recompute", False), ("swap", False), ("auto", False), ("recompute", True), ("swap", True), ("auto", True)]
VOCAB = range(3, 259)  # the default model's byte tokens, past its three special tokens


def oversubscribed_workload(num_requests: int, scale: int = 4, seed: int = 0,
                            vocab: range = VOCAB) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts (token ids drawn from ``vocab``) and sampling params: ShareGPT-like lengths divided by ``scale``."""
    rng = random.Random(seed)
    prompts, params = [], []
    for prompt_len, output_len in sharegpt_like_lengths(num_requests, seed=seed):
        prompts.append([rng.choice(vocab) for _ in range(max(1, prompt_len // scale))])
        params.append(SamplingParams(max_tokens=max(1, output_len // scale), ignore_eos=True))
    return prompts, params


def blocks_needed(prompts: list[list[int]], params: list[SamplingParams], block_size: int) -> int:
    """Device blocks the requests hold if all of them run to the end at once."""
    return sum(blocks_for(len(p) + s.max_tokens, block_size) for p, s in zip(prompts, params))


def serve(config: EngineConfig, prompts, params, model="default", progress=None) -> tuple[LLM, list[list[int]], float]:
    """Serve the workload on ``model``; return the engine, each request's tokens and the wall-clock seconds.

    ``progress``: a label for a bar over the tokens this run generates, or a
    :class:`kvlib.course.progress.TokenProgress` that several runs share; None for no bar.
    """
    llm = LLM(model, config, verbose=False)
    start = time.perf_counter()
    with counting(progress, llm, params, len(prompts)):
        outs = llm.generate(prompts, params)
    return llm, [o.token_ids for o in outs], time.perf_counter() - start


def result_row(label: str, partial: Optional[bool], llm: LLM, seconds: float, identical: Optional[bool]) -> dict:
    s = llm.metrics.summary()
    return {
        "mode": label, "partial": partial, "device blocks": llm.engine.config.num_gpu_blocks,
        "tokens/s": s["num_generated_tokens"] / seconds,
        "TTFT p50 ms": 1e3 * s["ttft_p50"], "TTFT p99 ms": 1e3 * s["ttft_p99"],
        "worst stutter ms": 1e3 * s["max_inter_token_latency"],
        "preemptions": s["num_preemptions"], "by swap": s["num_preemptions_swap"],
        "by recompute": s["num_preemptions_recompute"], "swap fallbacks": s["num_swap_fallbacks"],
        "swapped-out blocks": s["num_swapped_out_blocks"], "recomputed tokens": s["num_recomputed_tokens"],
        "swap ms": 1e3 * s["swap_time"], "recompute ms": 1e3 * s["recompute_time"],
        "preemptions/request": s["preemptions_per_finished_request"],
        "warned": llm.engine.oversubscription.warned, "outputs identical": identical,
    }


def run_preemption_bench(num_requests: int = 64, scale: int = 4, num_gpu_blocks: int = 48, num_cpu_blocks: int = 256,
                         block_size: int = 16, seed: int = 0, modes=MODES, model="default",
                         vocab: range = VOCAB, progress: bool = False) -> list[dict]:
    """The unpressured reference row, then one row per (mode, partial) in ``modes``: ``preemption_rows``'s rows."""
    return list(preemption_rows(num_requests, scale, num_gpu_blocks, num_cpu_blocks, block_size, seed, modes, model,
                                vocab, progress))


def preemption_rows(num_requests: int, scale: int, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                    seed: int, modes, model, vocab: range, progress: bool = False) -> Iterator[dict]:
    """Each row as soon as its run ends (a caller with a time limit keeps the rows before it): the unpressured
    reference, then one per (mode, partial) in ``modes``, all on ``model`` with prompt tokens from ``vocab``;
    ``progress``: one bar over the tokens of every run."""
    prompts, params = oversubscribed_workload(num_requests, scale, seed, vocab)
    roomy = EngineConfig(block_size=block_size, num_gpu_blocks=blocks_needed(prompts, params, block_size),
                         max_num_seqs=num_requests)
    total = tokens_of(params[:4]) + (1 + len(modes)) * tokens_of(params)
    with TokenProgress(total, f"{1 + len(modes)} runs") if progress else contextlib.nullcontext() as bar:
        serve(roomy, prompts[:4], params[:4], model, bar)  # warm-up: first-call costs fall on no measured row
        llm, reference, seconds = serve(roomy, prompts, params, model, bar)
        yield result_row("none (pool fits all)", None, llm, seconds, None)
        for mode, partial in modes:
            config = EngineConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                                  preemption_mode=mode, partial_preemption=partial, max_num_seqs=num_requests)
            llm, outputs, seconds = serve(config, prompts, params, model, bar)
            yield result_row(mode, partial, llm, seconds, outputs == reference)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvlib bench preemption``."""
    parser = argparse.ArgumentParser(prog="kvlib bench preemption", description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64, help="requests, all submitted at once")
    parser.add_argument("--scale", type=int, default=4, help="divide the ShareGPT-like lengths by this")
    parser.add_argument("--num-gpu-blocks", type=int, default=48, help="KV blocks on the device (too few on purpose)")
    parser.add_argument("--num-cpu-blocks", type=int, default=256, help="KV blocks in host memory, for swapping")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and the prompt tokens")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (0: torch's default); the default model gains little from more, "
                             "and one thread keeps it steady on a machine shared with other jobs")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts, params = oversubscribed_workload(args.num_requests, args.scale, args.seed)
    need = blocks_needed(prompts, params, args.block_size)
    logger, level = logging.getLogger("kvlib"), logging.getLogger("kvlib").level
    logger.setLevel(logging.ERROR)  # the "warned" column reports the engine's warning instead
    try:
        rows = run_preemption_bench(args.num_requests, args.scale, args.num_gpu_blocks, args.num_cpu_blocks,
                                    args.block_size, args.seed, progress=True)
    finally:
        logger.setLevel(level)
    print(format_table(rows, f"Preemption: {args.num_requests} ShareGPT-like requests / {args.scale}, default model, "
                             f"{need} blocks of {args.block_size} needed at once, {args.num_gpu_blocks} device blocks, "
                             f"{args.num_cpu_blocks} host blocks, {torch.get_num_threads()} torch CPU thread(s)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
