"""The server under load: many concurrent streaming clients through a pool far too small for them.

Every request comes back whole and token-exact (greedy outputs do not depend on preemption),
``/metrics`` shows the preemptions, and afterwards the pools hold nothing. A disconnect storm
(clients closing mid-stream, or leaving before their first token) aborts every request it leaves
behind, frees every block, and the server goes on serving. A hostile client (a 16 MB body, 10,000
prompts in one request, a 1.5 MB prompt) is refused beside 32 streaming clients while ``/health``
answers throughout. TTFT, stutter and ``/health`` percentiles are printed (``pytest -s``) as the run
measured them; no test judges a timing.
"""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.cli.bench.serve import hostile_bodies, hostile_client
from kvlib.metrics import percentile
from kvlib.serve.server import BackgroundServer
from serve_helpers import ended_requests, scrape, settled_pools

NUM_CLIENTS = 64
EMPTY = {"unfinished": False, "device_blocks_held": 0, "host_blocks_held": 0}


def workload(count: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) pairs of mixed lengths; the byte tokens of the built-in model."""
    rng = random.Random(seed)
    return [([rng.randrange(3, 259) for _ in range(rng.randint(8, 40))], rng.randint(8, 24)) for _ in range(count)]


@pytest.fixture(params=["swap", "recompute"])
def server(request):
    """16 blocks of 8 tokens: a handful of the 64 requests fit at once, so the rest wait, or are preempted."""
    config = EngineConfig(block_size=8, num_gpu_blocks=16, num_cpu_blocks=64, preemption_mode=request.param,
                          max_num_seqs=16)
    with BackgroundServer(LLM("default", config, verbose=False), "default") as server:
        yield server


async def stream_one(client, prompt: list[int], max_tokens: int) -> dict:
    start = time.perf_counter()
    arrivals, tokens = [], []
    stream = await client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in stream:
        arrivals.append(time.perf_counter())
        tokens += chunk.choices[0].token_ids
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"tokens": tokens, "ttft": arrivals[0] - start, "stutter": max(gaps, default=0.0)}


def report(label: str, results: list[dict]) -> None:
    for key in ("ttft", "stutter"):
        values = sorted(r[key] for r in results)
        print(f"{label} {key} ms: p50 {1e3 * percentile(values, 50):.1f}, p90 {1e3 * percentile(values, 90):.1f}, "
              f"p99 {1e3 * percentile(values, 99):.1f}")


def test_64_streaming_clients_through_a_tiny_pool_lose_nothing_and_leak_nothing(server):
    requests = workload(NUM_CLIENTS, seed=1)
    oracle = LLM("default", EngineConfig(block_size=8, num_gpu_blocks=512, max_num_seqs=NUM_CLIENTS), verbose=False)
    expected = oracle.generate([p for p, _ in requests], [SamplingParams(max_tokens=m, ignore_eos=True)
                                                         for _, m in requests])

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(stream_one(client, p, m) for p, m in requests))

    results = asyncio.run(run())
    assert [r["tokens"] for r in results] == [e.token_ids for e in expected]
    metrics = scrape(server.url)
    assert metrics["vllm:num_preemptions_total"] > 0
    assert metrics["vllm:e2e_request_latency_seconds_count"] == NUM_CLIENTS
    assert metrics["vllm:generation_tokens_total"] >= sum(m for _, m in requests)
    assert (metrics["vllm:num_requests_running"], metrics["vllm:num_requests_waiting"],
            metrics["vllm:num_requests_swapped"], metrics["vllm:gpu_cache_usage_perc"]) == (0, 0, 0, 0)
    assert settled_pools(server) == EMPTY
    report(f"{NUM_CLIENTS} clients, {metrics['vllm:num_preemptions_total']:.0f} preemptions:", results)


async def leave_early(client, prompt: list[int], max_tokens: int, after_chunks: int) -> bool:
    """Stream, then close the connection after ``after_chunks`` chunks (0: as soon as the server has taken
    the request, before its first token); True if the client saw the request end first."""
    stream = await client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, stream=True,
                                             extra_body={"ignore_eos": True})
    seen = 0
    if after_chunks:
        async for chunk in stream:
            seen += 1
            if chunk.choices[0].finish_reason is not None:
                return True
            if seen >= after_chunks:
                break
    await stream.close()
    return False


def test_a_disconnect_storm_aborts_every_request_it_leaves_and_frees_every_block(server):
    requests = workload(48, seed=2)
    rng = random.Random(3)

    async def storm():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(leave_early(client, p, m, 0 if i < 8 else rng.randint(1, 6))
                                          for i, (p, m) in enumerate(requests)))

    ended = asyncio.run(storm())
    metrics = ended_requests(server.url, len(requests))
    assert settled_pools(server) == EMPTY
    # each request ended in the engine one way: aborted, or finished before its client's close arrived
    finished = metrics.get("vllm:request_success_total", 0)
    assert metrics["kvlib:num_requests_aborted_total"] + finished == len(requests)
    assert finished >= sum(ended)
    assert metrics["kvlib:num_requests_aborted_total"] >= 8  # at least those closed before their first token
    assert metrics["vllm:num_requests_running"] == metrics["vllm:num_requests_waiting"] == 0
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        out = client.completions.create(model="default", prompt=requests[0][0], max_tokens=12, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
    expected = LLM("default", verbose=False).generate(requests[0][0], SamplingParams(max_tokens=12, ignore_eos=True))
    assert out.choices[0].token_ids == expected[0].token_ids
    assert settled_pools(server) == EMPTY


def test_a_client_that_leaves_a_whole_request_while_it_runs_aborts_it(server):
    """Not streamed: the server notices the closed connection while it generates, not only when it would reply."""
    async def leave_while_running():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            reply = asyncio.create_task(client.post("/v1/completions", json={
                "model": "default", "prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True}))
            while scrape(server.url)["vllm:num_requests_running"] == 0:
                await asyncio.sleep(0.005)
            reply.cancel()  # closes the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await reply

    asyncio.run(leave_while_running())
    metrics = ended_requests(server.url, 1)
    assert settled_pools(server) == EMPTY
    assert (metrics["kvlib:num_requests_aborted_total"], metrics.get("vllm:request_success_total", 0)) == (1, 0)


async def poll_health(client: httpx.AsyncClient, done: asyncio.Event) -> list[tuple[int, float]]:
    """/health asked over and over while the clients run: (status, seconds it took), the timing only reported."""
    answers = []
    while not done.is_set():
        start = time.perf_counter()
        reply = await client.get("/health")
        answers.append((reply.status_code, time.perf_counter() - start))
        await asyncio.sleep(0.005)
    return answers


def run_clients(server, requests, with_hostile: bool) -> tuple[list[dict], list[str], list[tuple[int, float]]]:
    async def run():
        done, bodies = asyncio.Event(), hostile_bodies() if with_hostile else []
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client, \
                httpx.AsyncClient(base_url=server.url, timeout=120) as raw, \
                httpx.AsyncClient(base_url=server.url, timeout=120) as prober:
            attack = asyncio.create_task(hostile_client(raw, done, bodies)) if with_hostile else None
            health = asyncio.create_task(poll_health(prober, done))
            results = await asyncio.gather(*(stream_one(client, p, m) for p, m in requests))
            done.set()
            return results, (await attack if attack else []), await health

    return asyncio.run(run())


def test_a_hostile_client_beside_32_streaming_clients_is_refused_and_holds_nobody_up():
    """Every hostile request is refused by a limit before it reaches the engine, the 32 ordinary streams come back
    whole and token-exact, and /health answers 200 all along (its latency and the clients' TTFT are printed with
    and without the hostile client, for ``pytest -s``; no test judges them)."""
    requests = workload(32, seed=4)
    oracle = LLM("default", EngineConfig(block_size=8, num_gpu_blocks=512, max_num_seqs=32), verbose=False)
    expected = oracle.generate([p for p, _ in requests], [SamplingParams(max_tokens=m, ignore_eos=True)
                                                         for _, m in requests])
    config = EngineConfig(block_size=8, num_gpu_blocks=32, num_cpu_blocks=64, preemption_mode="swap", max_num_seqs=16)
    with BackgroundServer(LLM("default", config, verbose=False), "default") as server:
        quiet, _, quiet_health = run_clients(server, requests, with_hostile=False)
        prompt_tokens = scrape(server.url)["vllm:prompt_tokens_total"]
        results, outcomes, health = run_clients(server, requests, with_hostile=True)
        metrics = scrape(server.url)
        assert settled_pools(server) == EMPTY
    assert [r["tokens"] for r in results] == [e.token_ids for e in expected] == [r["tokens"] for r in quiet]
    assert set(outcomes[0::3]) <= {"413 request_too_large", "closed"}  # closed: on a body it would not read
    assert set(outcomes[1::3]) == {"400 too_many_prompts"} and set(outcomes[2::3]) == {"400 too_many_prompt_tokens"}
    assert metrics["vllm:prompt_tokens_total"] == 2 * prompt_tokens  # the ordinary clients' twice, nothing else
    assert health and all(status == 200 for status, _ in health)
    report("32 clients alone:", quiet)
    report("32 clients beside a hostile one:", results)
    for label, answers in (("alone", quiet_health), ("beside the hostile client", health)):
        seconds = sorted(s for _, s in answers)
        print(f"/health {label}: {len(seconds)} answers, p50 {1e3 * percentile(seconds, 50):.1f} ms, "
              f"p99 {1e3 * percentile(seconds, 99):.1f} ms, max {1e3 * seconds[-1]:.1f} ms")
