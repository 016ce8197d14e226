"""``kvlib bench memory``: how much KV memory paging saves, measured on kvlib's own block allocator.

Each scheme serves the same ShareGPT-like workload (``kvlib.cli.bench.workloads``) in the same fixed
memory of ``memory_slots`` KV slots (one slot holds one token's K and V for every layer), one
engine step at a time, with no model forward: only the memory bookkeeping is simulated.

- A sequence is admitted in arrival order when the scheme can place it. After each step it
  holds its prompt plus the tokens generated so far (the last sampled token's K/V is never
  written), so a sequence with a prompt of ``p`` and an output of ``o`` tokens holds
  ``p, p + 1, ..., p + o - 1`` tokens over its ``o`` steps.
- Measured at every step, for every running sequence: slots allocated against tokens held.
  Waste is the fraction of allocated slot-steps that held no token, over the whole run, so
  long-lived sequences count in proportion to how long they occupy memory.
- Concurrent sequences is the mean number running over the steps where requests were still
  queued, i.e. while memory, not demand, limited the batch. There is no batch-size cap.

Schemes:

- ``paged``: kvlib's ``BlockAllocator`` and ``BlockTable``. A sequence takes a block only when
  its next token needs one; admission keeps a 1% watermark free, as the engine does; when the
  pool runs dry the newest running sequence is preempted (its blocks freed, its tokens to be
  recomputed on readmission), as the engine's default policy does.
- ``contiguous, max_len``: one contiguous run of ``max_len`` slots (the model context) per
  sequence, reserved at admission, because the final length is unknown.
- ``contiguous, prompt + max_tokens``: one contiguous run of ``prompt + max_tokens`` slots, first
  fit. A request's ``max_tokens`` is taken as the next power of two at or above the output it
  actually produces (capped by the context): a tighter cap than most clients set, so this
  variant flatters contiguous allocation. Its runs differ in size, so the free space also
  fragments between runs.
"""
from __future__ import annotations

import argparse
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvlib.cli.bench.report import format_table
from kvlib.cli.bench.workloads import sharegpt_like_lengths
from kvlib.core.block_allocator import AllocStatus, BlockAllocator
from kvlib.core.block_table import BlockTable, blocks_for
from kvlib.model.config import ModelConfig
from kvlib.model.default import DEFAULT_CONFIG
from kvlib.runner.kv_cache import KVCacheSpec

WATERMARK = 0.01  # EngineConfig's default

LLAMA3_8B_CONFIG = {  # the attention shape of meta-llama/Meta-Llama-3-8B's config.json
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
}


@dataclass
class Request:
    """One request's lengths and progress: after its next step it holds ``prompt + done`` tokens."""

    index: int
    prompt: int
    output: int
    done: int = 0
    running: bool = False

    @property
    def tokens(self) -> int:
        return self.prompt + self.done


class PagedScheme:
    """Blocks on demand from kvlib's allocator, one block table per sequence."""

    name = "paged"

    def __init__(self, memory_slots: int, block_size: int):
        self.block_size = block_size
        self.allocator = BlockAllocator(memory_slots // block_size)
        self.watermark_blocks = int(WATERMARK * self.allocator.num_blocks)
        self.tables: dict[int, BlockTable] = {}

    def admit(self, req: Request) -> bool:
        needed = blocks_for(req.tokens, self.block_size)
        if self.allocator.can_allocate(needed, self.watermark_blocks) is not AllocStatus.OK:
            return False
        self.tables[req.index] = BlockTable(self.block_size)
        return self.grow(req)

    def grow(self, req: Request) -> bool:
        table = self.tables[req.index]
        missing = table.num_missing_blocks(req.tokens)
        if missing > self.allocator.num_free:
            return False
        for _ in range(missing):
            table.append(self.allocator.allocate())
        return True

    def release(self, req: Request) -> None:
        table = self.tables.pop(req.index)
        for block in table.pop_tail(len(table)):
            self.allocator.free(block)

    def allocated(self, req: Request) -> int:
        return self.tables[req.index].capacity


class ContiguousScheme:
    """One run of consecutive slots per sequence, sized at admission by ``reserve``, placed first fit."""

    def __init__(self, name: str, memory_slots: int, reserve: Callable[[Request], int]):
        self.name = name
        self.reserve = reserve
        self.free_runs: list[tuple[int, int]] = [(0, memory_slots)]  # (start, length), sorted by start
        self.runs: dict[int, tuple[int, int]] = {}

    def admit(self, req: Request) -> bool:
        size = self.reserve(req)
        for i, (start, length) in enumerate(self.free_runs):
            if length >= size:
                self.free_runs[i:i + 1] = [(start + size, length - size)] if length > size else []
                self.runs[req.index] = (start, size)
                return True
        return False

    def grow(self, req: Request) -> bool:
        return True  # the reservation made at admission covers the whole sequence

    def release(self, req: Request) -> None:
        start, size = self.runs.pop(req.index)
        runs = sorted(self.free_runs + [(start, size)])
        merged = [runs[0]]
        for s, n in runs[1:]:
            last_start, last_len = merged[-1]
            if last_start + last_len == s:
                merged[-1] = (last_start, last_len + n)
            else:
                merged.append((s, n))
        self.free_runs = merged

    def allocated(self, req: Request) -> int:
        return self.runs[req.index][1]


@dataclass
class ServeResult:
    slot_steps: int = 0  # sum over steps of slots allocated to running sequences
    token_steps: int = 0  # sum over steps of tokens those sequences held
    sequence_steps: int = 0  # sum over steps of running sequences
    saturated_steps: int = 0  # steps with requests still queued
    saturated_sequences: int = 0  # running sequences summed over those steps
    preemptions: int = 0

    @property
    def waste(self) -> float:
        return 1.0 - self.token_steps / self.slot_steps

    @property
    def concurrent(self) -> Optional[float]:
        """None when the queue always emptied: memory never limited the batch."""
        return self.saturated_sequences / self.saturated_steps if self.saturated_steps else None

    @property
    def slots_per_sequence(self) -> float:
        return self.slot_steps / self.sequence_steps


def serve(scheme, lengths: list[tuple[int, int]]) -> ServeResult:
    """Run the workload through ``scheme`` step by step and count slots against tokens."""
    queue = deque(Request(i, p, o) for i, (p, o) in enumerate(lengths))
    running: list[Request] = []  # oldest first
    result = ServeResult()
    while queue or running:
        preempted = False
        for req in list(running):
            while req.running and not scheme.grow(req):
                victim = running.pop()  # the newest: it has waited least
                scheme.release(victim)
                victim.running = False
                queue.appendleft(victim)  # it is older than anything still queued
                result.preemptions += 1
                preempted = True
        if not preempted:
            while queue and scheme.admit(queue[0]):
                req = queue.popleft()
                req.running = True
                running.append(req)
        if not running:
            raise ValueError(f"a request of {queue[0].prompt} + {queue[0].output} tokens cannot be placed in an empty "
                             f"memory under scheme {scheme.name!r}; raise memory_slots")
        result.slot_steps += sum(scheme.allocated(r) for r in running)
        result.token_steps += sum(r.tokens for r in running)
        result.sequence_steps += len(running)
        if queue:
            result.saturated_steps += 1
            result.saturated_sequences += len(running)
        for req in running:
            req.done += 1
        for req in running:
            if req.done == req.output:
                scheme.release(req)
                req.running = False
        running = [r for r in running if r.running]
    return result


def next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype = torch.float16) -> int:
    """K and V for every layer and KV head: what one cached token costs."""
    return KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, 1, dtype).bytes_per_token


def run_memory_bench(num_requests: int = 1000, block_size: int = 16, seed: int = 0, max_len: int = 2048,
                     memory_slots: Optional[int] = None) -> list[dict]:
    """One row per scheme: waste, slots per sequence, concurrent sequences, and the ratio to max_len reservation.

    ``memory_slots`` defaults to room for 32 max-length reservations.
    """
    memory_slots = memory_slots or 32 * max_len
    lengths = sharegpt_like_lengths(num_requests, seed=seed, max_len=max_len)
    schemes = [
        PagedScheme(memory_slots, block_size),
        ContiguousScheme("contiguous, prompt + max_tokens", memory_slots,
                         lambda r: min(r.prompt + next_power_of_two(r.output), max_len)),
        ContiguousScheme("contiguous, max_len", memory_slots, lambda r: max_len),
    ]
    results = {s.name: serve(s, lengths) for s in schemes}
    baseline = results["contiguous, max_len"].concurrent
    llama_mib_per_slot = kv_bytes_per_token(ModelConfig.from_dict(LLAMA3_8B_CONFIG)) / 2**20
    return [{
        "scheme": name,
        "waste %": 100 * r.waste,
        "slots/seq": r.slots_per_sequence,
        "Llama-3-8B MiB/seq": r.slots_per_sequence * llama_mib_per_slot,
        "concurrent seqs": r.concurrent,
        "x max_len": r.concurrent / baseline if r.concurrent and baseline else None,
        "preemptions": r.preemptions,
    } for name, r in results.items()]


def kv_bytes_rows(dtype: torch.dtype = torch.float16) -> list[dict]:
    """KV bytes per token of the default model and of Llama-3-8B, with and without grouped-query attention."""
    rows = []
    for name, raw in [("kvlib default", DEFAULT_CONFIG), ("Llama-3-8B", LLAMA3_8B_CONFIG)]:
        config = ModelConfig.from_dict(raw)
        every_head = ModelConfig.from_dict({**raw, "num_key_value_heads": config.num_heads})
        rows.append({
            "model": name, "layers": config.num_layers, "heads": config.num_heads, "kv heads": config.num_kv_heads,
            "head dim": config.head_dim, "dtype": str(dtype).removeprefix("torch."),
            "KiB/token": kv_bytes_per_token(config, dtype) / 1024,
            "KiB/token without GQA": kv_bytes_per_token(every_head, dtype) / 1024,
        })
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvlib bench memory``."""
    parser = argparse.ArgumentParser(prog="kvlib bench memory", description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1000, help="ShareGPT-like requests served")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block of the paged scheme")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request lengths")
    parser.add_argument("--max-len", type=int, default=2048,
                        help="the model's context: the longest request, and what a max_len reservation holds")
    parser.add_argument("--memory-slots", type=int, default=None,
                        help="KV slots every scheme shares (default: room for 32 max-length reservations)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Print the KV-size table and the waste table."""
    args = build_parser().parse_args(argv)
    print(format_table(kv_bytes_rows(), "KV cache size per token"))
    print()
    slots = args.memory_slots or 32 * args.max_len
    rows = run_memory_bench(args.num_requests, args.block_size, args.seed, args.max_len, slots)
    print(format_table(rows, f"KV memory on a ShareGPT-like workload: {args.num_requests} requests, "
                             f"{slots:,} slots, block size {args.block_size}, context {args.max_len}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
