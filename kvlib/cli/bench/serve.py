"""``kvlib bench serve``: requests arriving at random over HTTP, as vLLM's serving benchmark sends them.

- Arrivals: a Poisson process of ``--rate`` requests per second (exponential gaps, seeded), so
  requests come while others run, the case preemption exists for. ``--rate inf`` sends all at once.
- Requests: ShareGPT-like lengths (``kvlib.cli.bench.workloads``) divided by ``--scale``, random
  prompt token ids (3 to 258, valid for any model with a vocabulary larger than that), streamed
  completions with ``ignore_eos`` so each generates exactly its drawn length.
- The server: started in this process on the built-in model with a deliberately small pool
  (``--num-gpu-blocks``), or any running ``kvlib serve`` (or vLLM) given with ``--url``.
- Measured at the client: TTFT (request sent to first token), TPOT (the time per output token after
  the first), end-to-end latency; p50, p90 and p99. Preemptions are the growth of
  ``vllm:num_preemptions_total`` over the run. ``/metrics`` is sampled every ``--sample-interval``
  seconds into the KV-usage timeline, saved as JSON, or drawn when the path ends in ``.png``; ``/health``
  is asked at each sample, and how long it took to answer is reported too.
- ``--hostile``: beside the ordinary requests, a client sends what no server should queue (a 16 MB
  body, 10,000 prompts in one request, a 1.5 MB text prompt) until they are done; what it got is
  reported, and the ordinary requests' figures show what it cost them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from pathlib import Path
from typing import Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvlib.cli.bench.report import format_table
from kvlib.cli.bench.workloads import sharegpt_like_lengths
from kvlib.metrics import percentile

VOCAB = range(3, 259)
TIMELINE_METRICS = {"vllm:gpu_cache_usage_perc": "gpu_cache_usage", "vllm:cpu_cache_usage_perc": "cpu_cache_usage",
                    "vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
                    "vllm:num_requests_swapped": "swapped", "vllm:num_preemptions_total": "preemptions"}


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds from the start at which each request is sent: exponential gaps of mean ``1 / rate``."""
    if math.isinf(rate):
        return [0.0] * count
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def workload(count: int, scale: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.choice(VOCAB) for _ in range(max(1, p // scale))], max(1, o // scale))
            for p, o in sharegpt_like_lengths(count, seed=seed)]


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    """Stream one completion; its client-side timings, or the error it met."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start, first, tokens = time.perf_counter(), None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    return {"error": chunk["error"]["message"]}
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif first is None:
                    first = time.perf_counter()
    except httpx.HTTPError as err:
        return {"error": f"{type(err).__name__}: {err}"}
    end = time.perf_counter()
    if first is None:
        return {"error": "the stream ended without a token"}
    return {"ttft": first - start, "e2e": end - start, "output_tokens": tokens,
            "tpot": (end - first) / (tokens - 1) if tokens > 1 else None}


def hostile_bodies(model: str = "default") -> list[bytes]:
    """Requests no server should queue: a 16 MB body, 10,000 prompts in one request, a 1.5 MB text prompt."""
    return [json.dumps({"model": model, "prompt": "x" * 16_000_000}).encode(),
            json.dumps({"model": model, "prompt": [[5, 6, 7]] * 10_000}).encode(),
            json.dumps({"model": model, "prompt": "a few words " * 125_000}).encode()]


async def hostile_client(client: httpx.AsyncClient, done: asyncio.Event, bodies: list[bytes],
                         rounds: int = 3) -> list[str]:
    """``bodies`` (built beforehand, so that their encoding delays no client) sent until ``done`` is set (each at
    least once, ``rounds`` times at most). What each got: its status and error code, or ``closed`` (the server
    closed the connection on a body it would not read) or ``timeout`` (60 s)."""
    outcomes = []
    for _ in range(rounds):
        for body in bodies:
            try:
                reply = await client.post("/v1/completions", content=body, timeout=60.0,
                                          headers={"content-type": "application/json"})
            except httpx.TimeoutException:
                outcomes.append("timeout")
            except httpx.TransportError:
                outcomes.append("closed")
            else:
                outcomes.append(f"{reply.status_code} {_error_code(reply)}".strip())
        if done.is_set():
            break
    return outcomes


def _error_code(reply: httpx.Response) -> str:
    """The ``code`` of an OpenAI error body, or nothing."""
    try:
        error = reply.json().get("error")
    except (ValueError, AttributeError):
        return ""
    return str(error.get("code") or "") if isinstance(error, dict) else ""


async def scrape(client: httpx.AsyncClient) -> dict:
    text = (await client.get("/metrics")).text
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return {key: samples.get(name, 0.0) for name, key in TIMELINE_METRICS.items()}


async def health_seconds(client: httpx.AsyncClient) -> float:
    start = time.perf_counter()
    (await client.get("/health")).raise_for_status()
    return time.perf_counter() - start


async def drive(url: str, requests: list[tuple[list[int], int]], arrivals: list[float], sample_interval: float,
                hostile: bool = False) -> tuple[list[dict], list[dict], float, list[float], list[str]]:
    """Send each request at its arrival time while sampling ``/metrics`` and ``/health`` (and, with ``hostile``,
    beside a hostile client); results, timeline, seconds, /health's answer times, the hostile client's outcomes."""
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        bodies = hostile_bodies(model) if hostile else []
        start, timeline, health, done = time.perf_counter(), [], [], asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                health.append(await health_seconds(client))
                timeline.append({"seconds": time.perf_counter() - start, **await scrape(client)})
                try:
                    await asyncio.wait_for(done.wait(), sample_interval)
                except asyncio.TimeoutError:
                    pass
            timeline.append({"seconds": time.perf_counter() - start, **await scrape(client)})

        async def send(at: float, prompt: list[int], max_tokens: int) -> dict:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await one_request(client, model, prompt, max_tokens)

        sampler = asyncio.create_task(sample())
        attack = asyncio.create_task(hostile_client(client, done, bodies)) if hostile else None
        results = await asyncio.gather(*(send(at, p, m) for at, (p, m) in zip(arrivals, requests)))
        seconds = time.perf_counter() - start
        done.set()
        await sampler
        outcomes = await attack if attack else []
    return list(results), timeline, seconds, health, outcomes


def summarize(results: list[dict], timeline: list[dict], seconds: float, health: list[float],
              outcomes: list[str]) -> dict:
    ok = [r for r in results if "error" not in r]
    report = {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
              "seconds": seconds, "requests/s": len(ok) / seconds,
              "output tokens": sum(r["output_tokens"] for r in ok),
              "output tokens/s": sum(r["output_tokens"] for r in ok) / seconds}
    for key in ("ttft", "tpot", "e2e"):
        values = sorted(r[key] for r in ok if r[key] is not None)
        for q in (50, 90, 99):
            value = percentile(values, q)
            report[f"{key.upper()} p{q} ms"] = None if value is None else 1e3 * value
    report["preemptions"] = int(timeline[-1]["preemptions"] - timeline[0]["preemptions"]) if timeline else None
    report["peak KV usage"] = max((s["gpu_cache_usage"] for s in timeline), default=None)
    health = sorted(health)
    for q in (50, 99):
        value = percentile(health, q)
        report[f"/health p{q} ms"] = None if value is None else 1e3 * value
    report["/health max ms"] = 1e3 * health[-1] if health else None
    report["hostile requests"] = ", ".join(f"{outcomes.count(o)} x {o}" for o in dict.fromkeys(outcomes)) or None
    report["errors"] = sorted({r["error"] for r in results if "error" in r})[:3]
    return report


def save_timeline(timeline: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix != ".png":
        path.write_text(json.dumps(timeline, indent=1))
        return path
    from matplotlib.figure import Figure
    ax = Figure(figsize=(8, 3.5)).subplots()
    xs = [s["seconds"] for s in timeline]
    ax.plot(xs, [s["gpu_cache_usage"] for s in timeline], label="device KV usage (vllm:gpu_cache_usage_perc)")
    ax.plot(xs, [s["cpu_cache_usage"] for s in timeline], label="host KV usage (vllm:cpu_cache_usage_perc)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of the pool")
    twin = ax.twinx()
    twin.step(xs, [s["preemptions"] - timeline[0]["preemptions"] for s in timeline], color="red", where="post",
              label="preemptions so far")
    twin.set_ylabel("preemptions")
    ax.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    return path


def run_serve_bench(url: Optional[str] = None, num_requests: int = 64, rate: float = 16.0, scale: int = 4,
                    seed: int = 0, num_gpu_blocks: int = 48, num_cpu_blocks: int = 96, preemption_mode: str = "swap",
                    sample_interval: float = 0.1, timeline_path: Optional[str] = None, hostile: bool = False) -> dict:
    """The report as a dict; ``url=None`` serves the built-in model in this process for the run."""
    requests = workload(num_requests, scale, seed)
    arrivals = poisson_arrivals(num_requests, rate, seed)
    if url is None:
        from kvlib.config import EngineConfig
        from kvlib.llm import LLM
        from kvlib.serve.server import BackgroundServer
        config = EngineConfig(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                              preemption_mode=preemption_mode, max_num_seqs=max(num_requests, 1))
        with BackgroundServer(LLM("default", config, verbose=False), "default") as server:
            measured = asyncio.run(drive(server.url, requests, arrivals, sample_interval, hostile))
    else:
        measured = asyncio.run(drive(url.rstrip("/"), requests, arrivals, sample_interval, hostile))
    results, timeline, seconds, health, outcomes = measured
    report = summarize(results, timeline, seconds, health, outcomes)
    report["timeline"] = str(save_timeline(timeline, Path(timeline_path))) if timeline_path else None
    return report


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvlib bench serve``."""
    parser = argparse.ArgumentParser(prog="kvlib bench serve", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server to drive, e.g. http://127.0.0.1:8000 "
                                                    "(default: serve the built-in model in this process)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests sent in all")
    parser.add_argument("--rate", type=float, default=16.0, help="mean arrivals per second (inf: all at once)")
    parser.add_argument("--scale", type=int, default=4, help="divide the ShareGPT-like lengths by this")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths, the prompts and the arrivals")
    parser.add_argument("--num-gpu-blocks", type=int, default=48,
                        help="device KV blocks of the in-process server (too few on purpose)")
    parser.add_argument("--num-cpu-blocks", type=int, default=96, help="host KV blocks of the in-process server")
    parser.add_argument("--preemption-mode", default="swap", choices=("recompute", "swap", "auto"),
                        help="the in-process server's preemption mode")
    parser.add_argument("--sample-interval", type=float, default=0.1, help="seconds between two samples of /metrics")
    parser.add_argument("--timeline", default="kvlib-output/serve_timeline.json",
                        help="where the KV-usage timeline is saved (.json: the samples; .png: a plot)")
    parser.add_argument("--hostile", action="store_true",
                        help="send, beside the requests, a 16 MB body, 10,000 prompts in one request and a 1.5 MB "
                             "prompt, until the requests are done")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads of the in-process server (0: torch's default)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads and args.url is None:
        import torch
        torch.set_num_threads(args.threads)
    report = run_serve_bench(args.url, args.num_requests, args.rate, args.scale, args.seed, args.num_gpu_blocks,
                             args.num_cpu_blocks, args.preemption_mode, args.sample_interval, args.timeline,
                             args.hostile)
    target = args.url or (f"the built-in model in this process, {args.num_gpu_blocks} device blocks, "
                          f"{args.num_cpu_blocks} host blocks, {args.preemption_mode}")
    errors = report.pop("errors")
    rows = [{"measure": key, "value": value} for key, value in report.items()]
    print(format_table(rows, f"Serving: {args.num_requests} requests at {args.rate} per second (Poisson), "
                             f"ShareGPT-like lengths / {args.scale}, against {target}"))
    for error in errors:
        print(f"error: {error}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
