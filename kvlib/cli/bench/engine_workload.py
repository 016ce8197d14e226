"""What ``kvlib bench engine`` hands every engine alike: the workload, where they run, and the arrival loop."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvlib.cli.bench.workloads import sharegpt_like_lengths
from kvlib.metrics import percentile
from kvlib.runner.device import resolve_device, resolve_dtype


@dataclass
class Request:
    arrival: float  # seconds after the start
    prompt: list[int]
    max_tokens: int


def make_workload(num_requests: int, scale: float, rate: float, vocab_size: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    clock, requests = 0.0, []
    for prompt_len, output_len in sharegpt_like_lengths(num_requests, seed=seed, max_len=1024):
        clock += rng.expovariate(rate)
        prompt = [rng.randrange(3, vocab_size) for _ in range(max(1, round(prompt_len * scale)))]
        requests.append(Request(clock, prompt, max(1, round(output_len * scale))))
    return requests


def latency_row(name: str, tokens: int, elapsed: float, ttfts: list[float], e2es: list[float],
                gaps: Optional[list[float]]) -> dict:
    """Throughput and latency percentiles; ``gaps`` are the inter-token gaps (None when they were not measured)."""
    ttfts, e2es, gaps = sorted(ttfts), sorted(e2es), sorted(gaps or [])
    return {"engine": name, "output tokens/s": tokens / elapsed, "TTFT p50 s": percentile(ttfts, 50),
            "TTFT p99 s": percentile(ttfts, 99), "E2E p50 s": percentile(e2es, 50), "E2E p99 s": percentile(e2es, 99),
            "ITL p50 s": percentile(gaps, 50), "ITL p99 s": percentile(gaps, 99), "wall s": elapsed}


@dataclass(frozen=True)
class Placement:
    """Where both engines run and in what dtype: the same for both, or the comparison says nothing."""

    device: torch.device
    dtype: torch.dtype

    @classmethod
    def auto(cls) -> "Placement":
        """kvlib's own choice with ``device="auto"``, ``dtype="auto"``."""
        device = resolve_device("auto")
        return cls(device, resolve_dtype("auto", device))

    def describe(self) -> str:
        return f"{self.device.type}, {str(self.dtype).removeprefix('torch.')}"


def placement_fields(placement: Placement) -> dict:
    return {"device": placement.device.type, "dtype": str(placement.dtype).removeprefix("torch.")}


Served = dict  # an engine's row for one pass over the workload; row["tokens"] holds each request's output tokens


def serve_as_they_arrive(requests: list[Request], submit: Callable[[int, Request, float], None],
                          poll: Callable[[], list[tuple[int, float, list[float], list[int]]]],
                          busy: Callable[[], bool]) -> tuple[float, dict, dict, dict]:
    """Hands each request to an engine at its arrival time; ``poll`` returns (index, finish time, token arrival times,
    tokens) for the requests that finished, the arrival times holding at least the first token's. Times are
    ``time.perf_counter``'s; those returned count from the start."""
    start, pending, arrivals, done, tokens = time.perf_counter(), list(enumerate(requests)), {}, {}, {}
    while pending or busy():
        now = time.perf_counter() - start
        while pending and pending[0][1].arrival <= now:
            i, r = pending.pop(0)
            submit(i, r, start + r.arrival)
        if not busy() and pending:
            time.sleep(max(0.0, pending[0][1].arrival - now))
            continue
        for i, finished, token_times, ids in poll():
            done[i], tokens[i], arrivals[i] = finished - start, ids, [t - start for t in token_times]
    return time.perf_counter() - start, arrivals, done, tokens


def inter_token_gaps(arrivals: dict[int, list[float]], tokens: dict[int, list[int]]) -> Optional[list[float]]:
    """Every gap between two consecutive tokens of a request, pooled over the requests (the inter-token latency
    serving benchmarks report); None when some request's arrival times do not cover each of its tokens."""
    if any(len(arrivals[i]) != len(tokens[i]) for i in tokens):
        return None
    return [later - earlier for times in arrivals.values() for earlier, later in zip(times, times[1:])]


def served_row(name: str, requests: list[Request], served: tuple[float, dict, dict, dict], slots: int) -> Served:
    elapsed, arrivals, done, tokens = served
    gaps = inter_token_gaps(arrivals, tokens)
    row = latency_row(name, sum(r.max_tokens for r in requests), elapsed,
                       [arrivals[i][0] - r.arrival for i, r in enumerate(requests)],
                       [done[i] - r.arrival for i, r in enumerate(requests)], gaps)
    if gaps is None:
        row["ITL note"] = f"not measured: {name} did not report when each token arrived"
    elif not gaps:
        row["ITL note"] = "not measured: no request asked for a second token"
    row.update({"KV slots": slots, "tokens": [tokens[i] for i in range(len(requests))]})
    return row


def require_fits(requests: list[Request], slots: int) -> None:
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    if longest > slots:
        raise ValueError(f"a request needs {longest} KV slots (prompt plus output) but the budget holds {slots}: "
                         f"raise --budget or lower --scale")
