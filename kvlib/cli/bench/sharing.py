"""``kvlib bench sharing``: KV blocks that copy-on-write sharing saves, measured on kvlib's own scheduler.

Every workload is served twice on the same requests, once with sharing and once without:

- Parallel sampling, ``n`` = 2, 4, 6 samples per request. Shared: one sequence is prefilled and
  the other samples fork from it, as the engine does, so they hold the prompt's
  blocks by reference and copy the last, partly filled one on their first write. Separate: ``n``
  independent requests with the same prompt, each holding its own copy.
- Few-shot prompts: every request starts with the same prefix, then its own question. The prefix
  lengths are those of the paper's one-shot (80 tokens) and five-shot (341 tokens) prompts.
  Shared: ``enable_prefix_caching=True``, so later requests reuse the prefix's full blocks;
  separate: prefix caching off.

Question and answer lengths come from ``sharegpt_like_lengths``, the mix ``kvlib bench memory``
uses (with a prefix, drawn for the context the prefix leaves). Token ids are unique per request,
so only the intended prefix is ever shared. Request ``i`` arrives before step ``i``: a steady
stream, so requests overlap in time and a computed prefix is there for the next one.

No model runs; everything else is the real engine's block accounting: kvlib's ``Scheduler`` and
``BlockManager`` (with its ``BlockAllocator``, ``PrefixCache`` and ``BlockSharing``), driven by
``kvlib.core.model_free``. After each step the scheduled tokens are
marked computed and their full blocks registered with the prefix cache, and each sequence that
reached its end gets a placeholder token, until it has its drawn answer length (as with
``ignore_eos``). The device pool holds every sequence at once, so nothing is preempted and the
blocks in use are exactly what the requests need.

Measured after every step, as the engine's own timeline is: blocks in use are the distinct blocks
in live sequences' tables (a cached block that no sequence uses can be reclaimed at once, so it
is not counted). ``saving %`` is ``1 - shared / separate`` over block-steps, i.e. of the mean;
that is the paper's ratio, blocks saved by sharing over the blocks used without it.
``prefill saved %`` is the share of prompt tokens that were not computed because their K/V was
shared.
"""
from __future__ import annotations

import argparse
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from kvlib.core.model_free import ModelFreeEngine, Request
from kvlib.cli.bench.report import format_table
from kvlib.cli.bench.workloads import sharegpt_like_lengths
from kvlib.config import EngineConfig
from kvlib.core.block_table import blocks_for

PAPER = "Kwon et al., SOSP 2023 (PagedAttention), sections 6.3-6.4"
PAPER_COLUMN = "paper's reported figure (other workloads)"
PAPER_PARALLEL = "6.1-9.8% Alpaca, 16.2-30.5% ShareGPT"
PAPER_PREFIX = {80: "1.67x throughput, 80-token prefix", 341: "3.58x throughput, 341-token prefix"}
PAPER_NOTE = (
    f"The last column quotes figures reported by {PAPER}; they are not measured here.\n"
    "Its memory saving is the same ratio, blocks saved by sharing over blocks without sharing: parallel sampling\n"
    "with 2-6 outputs, OPT-13B on Alpaca and ShareGPT traces (and for beam search, which kvlib does not do,\n"
    "37.6-55.2% on Alpaca, 44.3-66.3% on ShareGPT). For shared prefixes it reports throughput over Orca (Oracle),\n"
    "LLaMA-13B on WMT16 translation, not memory. Its models, traces, arrival rates and memory limits differ\n"
    "from this synthetic run.")


@dataclass
class Usage:
    """What one run held after each step, and what it computed and shared."""

    blocks: list[int] = field(default_factory=list)  # distinct blocks in use
    table_entries: list[int] = field(default_factory=list)  # block-table entries: the blocks with no sharing at all
    prefill_tokens: int = 0
    cow_copies: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0

    @property
    def peak_blocks(self) -> int:
        return max(self.blocks)

    @property
    def block_steps(self) -> int:
        return sum(self.blocks)

    @property
    def mean_blocks(self) -> float:
        return self.block_steps / len(self.blocks)


def sampling_requests(num_requests: int, n: int, seed: int = 0, max_len: int = 2048) -> list[Request]:
    """ShareGPT-like requests asking for ``n`` samples each, with unique token ids."""
    tokens = itertools.count()
    return [Request([next(tokens) for _ in range(p)], o, n, i)
            for i, (p, o) in enumerate(sharegpt_like_lengths(num_requests, seed, max_len))]


def few_shot_requests(num_requests: int, prefix_len: int, seed: int = 0, max_len: int = 2048) -> list[Request]:
    """A shared ``prefix_len``-token prefix, then each request's own ShareGPT-like question."""
    prefix, tokens = list(range(prefix_len)), itertools.count(prefix_len)
    return [Request(prefix + [next(tokens) for _ in range(p)], o, 1, i)
            for i, (p, o) in enumerate(sharegpt_like_lengths(num_requests, seed, max_len - prefix_len))]


def as_separate(requests: list[Request]) -> list[Request]:
    """Each sample as a request of its own: the same prompt, computed and stored ``n`` times."""
    return [Request(r.prompt, r.max_tokens, 1, r.arrival) for r in requests for _ in range(r.n)]


def roomy_config(requests: list[Request], block_size: int = 16, prefix_caching: bool = False) -> EngineConfig:
    """A pool and batch limits that hold every sequence of ``requests`` at once: nothing waits for memory."""
    num_seqs = sum(r.n for r in requests)
    return EngineConfig(block_size=block_size, enable_prefix_caching=prefix_caching, watermark=0.0,
                        num_gpu_blocks=sum(r.n * blocks_for(len(r.prompt) + r.max_tokens, block_size) for r in requests),
                        max_num_seqs=num_seqs, max_num_batched_tokens=sum(len(r.prompt) for r in requests) + num_seqs)


def serve(requests: list[Request], block_size: int = 16, prefix_caching: bool = False) -> Usage:
    """Run ``requests``, each added to the queue before its ``arrival`` step, through the scheduler to the end."""
    engine = ModelFreeEngine(roomy_config(requests, block_size, prefix_caching))
    usage = Usage()
    pending = deque(sorted(enumerate(requests), key=lambda item: item[1].arrival))
    while pending or engine.has_unfinished():
        while pending and pending[0][1].arrival <= len(usage.blocks):
            i, r = pending.popleft()
            engine.add(f"r{i}", r)
        engine.step()
        usage.prefill_tokens += sum(max(0, min(start + n, len(seq.prompt_token_ids)) - start)
                                    for (seq, n), start in zip(engine.last_plan.scheduled, engine.last_starts))
        tables = [seq.block_table.blocks for seq in engine.live_sequences()]
        usage.blocks.append(len({b for table in tables for b in table}))
        usage.table_entries.append(sum(map(len, tables)))
    m = engine.metrics
    usage.cow_copies, usage.preemptions = m.num_cow_copies, m.num_preemptions
    usage.prefix_hit_tokens = engine.block_manager.prefix_stats.hit_tokens
    return usage


def compare(workload: str, shared: Usage, separate: Usage, paper: str) -> dict:
    """One table row: the same requests with and without sharing."""
    return {
        "workload": workload,
        "peak separate": separate.peak_blocks, "peak shared": shared.peak_blocks,
        "mean separate": separate.mean_blocks, "mean shared": shared.mean_blocks,
        "saving %": 100 * (1 - shared.block_steps / separate.block_steps),
        "peak saving %": 100 * (1 - shared.peak_blocks / separate.peak_blocks),
        "prefill saved %": 100 * (1 - shared.prefill_tokens / separate.prefill_tokens),
        "CoW copies": shared.cow_copies, "prefix hit tokens": shared.prefix_hit_tokens,
        PAPER_COLUMN: paper,
    }


def run_sharing_bench(num_requests: int = 200, block_size: int = 16, seed: int = 0, max_len: int = 2048,
                      samples: tuple[int, ...] = (2, 4, 6), prefix_lens: tuple[int, ...] = (80, 341)) -> list[dict]:
    """One row per parallel-sampling ``n`` in ``samples``, then one per few-shot prefix length."""
    rows = []
    for n in samples:
        requests = sampling_requests(num_requests, n, seed, max_len)
        rows.append(compare(f"parallel sampling, n={n}", serve(requests, block_size),
                            serve(as_separate(requests), block_size), PAPER_PARALLEL))
    for prefix_len in prefix_lens:
        requests = few_shot_requests(num_requests, prefix_len, seed, max_len)
        rows.append(compare(f"few-shot, {prefix_len}-token prefix", serve(requests, block_size, prefix_caching=True),
                            serve(requests, block_size), PAPER_PREFIX.get(prefix_len, "")))
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvlib bench sharing``."""
    parser = argparse.ArgumentParser(prog="kvlib bench sharing", description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=200, help="ShareGPT-like requests served")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request lengths")
    parser.add_argument("--max-len", type=int, default=2048, help="the model's context: the longest request")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    rows = run_sharing_bench(args.num_requests, args.block_size, args.seed, args.max_len)
    print(format_table(rows, f"KV blocks in use, separate and shared: {args.num_requests} ShareGPT-like requests, "
                             f"one arriving per step, block size {args.block_size}, context {args.max_len}"))
    print()
    print(PAPER_NOTE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
