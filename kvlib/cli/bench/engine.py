"""``kvlib bench engine``: kvlib against transformers ``generate`` with static batches.

Same model (the same safetensors folder: ``--model default``, ``smollm2-135m`` or a folder), same
workload, same KV memory budget, one run:

- the workload is the ShareGPT-like length mix of :mod:`kvlib.cli.bench.workloads`, scaled down by
  ``--scale`` so it runs on a CPU, arriving as a Poisson process at ``--rate`` requests/s;
- kvlib gets a paged pool of ``budget`` token slots and serves requests as they arrive
  (continuous batching);
- transformers gets the same memory as a static reservation: its batch size times its padded
  length (the workload's longest prompt plus its longest output) is kvlib's pool,
  ``B = budget // (max prompt + max output)``. A batch starts when the previous one ends, with up
  to ``B`` requests that have arrived; it is padded to its longest prompt and runs until its
  longest output is done.

Both run on the same device in the same dtype, those kvlib picks for itself (``device="auto"``,
``dtype="auto"``: bfloat16 on a recent GPU, float32 on a CPU), and the report's title names them:
a transformers baseline left in float32 on the host would say nothing about kvlib on a GPU.

Both count only the tokens each request asked for (``ignore_eos``), report output tokens per
second over the whole run, time to first token and end-to-end latency per request. For kvlib a
second table says where its steps spent their time: scheduling (planning and recording), block
moves, the forward pass and, within it, attention, and sampling.

On a GPU, ``--compare-graphs`` serves the workload with kvlib twice, decode steps replayed from
CUDA graphs and launched eagerly, and adds both rows.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from kvlib.cli.bench.report import format_table
from kvlib.cli.bench.workloads import sharegpt_like_lengths
from kvlib.config import EngineConfig, SamplingParams
from kvlib.llm import LLM
from kvlib.metrics import percentile
from kvlib.model.catalog import resolve_model_folder
from kvlib.model.config import ModelConfig
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


def _latency_row(name: str, tokens: int, elapsed: float, ttfts: list[float], e2es: list[float]) -> dict:
    ttfts, e2es = sorted(ttfts), sorted(e2es)
    return {"engine": name, "output tokens/s": tokens / elapsed, "TTFT p50 s": percentile(ttfts, 50),
            "TTFT p99 s": percentile(ttfts, 99), "E2E p50 s": percentile(e2es, 50), "E2E p99 s": percentile(e2es, 99),
            "wall s": elapsed}


class StepProfile:
    """Seconds an engine's steps spend in each of their parts, gathered by wrapping the parts' methods."""

    PARTS = ("scheduling", "block moves", "forward", "attention", "sampling")

    def __init__(self, engine):
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.step_seconds = 0.0
        runner, scheduler = engine.runner, engine.scheduler
        for obj, method, part in [(scheduler, "schedule", "scheduling"), (scheduler, "postprocess", "scheduling"),
                                  (runner, "execute_moves", "block moves"), (runner, "forward", "forward"),
                                  (runner.backend, "forward", "attention"), (runner, "sample", "sampling"),
                                  (engine, "step", None)]:
            setattr(obj, method, self._timed(getattr(obj, method), part))

    def _timed(self, fn, part):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if part is None:
                    self.step_seconds += time.perf_counter() - start
                else:
                    self.seconds[part] += time.perf_counter() - start
        return timed

    def shares(self) -> dict:
        """Percent of the steps' time in each part (attention is part of the forward pass)."""
        total = self.step_seconds or 1.0
        shares = {f"{part} %": 100 * seconds / total for part, seconds in self.seconds.items()}
        shares["other %"] = 100 - sum(v for k, v in shares.items() if k != "attention %")
        return shares


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


def _fields(placement: Placement) -> dict:
    return {"device": placement.device.type, "dtype": str(placement.dtype).removeprefix("torch.")}


def run_kvlib(folder: Path, requests: list[Request], budget_tokens: int, block_size: int,
              cuda_graphs: bool = True, placement: Placement | None = None) -> dict:
    """kvlib's row; ``row["profile"]`` holds its step profile (``StepProfile.shares``)."""
    placement = placement or Placement.auto()
    config = EngineConfig(block_size=block_size, num_gpu_blocks=budget_tokens // block_size,
                          max_num_seqs=256, preemption_mode="recompute", **_fields(placement))
    llm = LLM(folder, config, verbose=False)
    engine = llm.engine
    if not cuda_graphs:
        engine.runner.set_decode_graphs(None)
    llm.generate([requests[0].prompt], SamplingParams(max_tokens=2))  # warm-up
    llm.metrics.reset()
    profile = StepProfile(engine)
    start, pending, first, done = time.perf_counter(), list(enumerate(requests)), {}, {}
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][1].arrival <= now:
            i, r = pending.pop(0)
            engine.add_request(str(i), r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                               arrival_time=start + r.arrival)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][1].arrival - now))
            continue
        for out in engine.step():
            t = time.perf_counter() - start
            first.setdefault(out.request_id, t)
            if out.finished:
                done[out.request_id] = t
    elapsed = time.perf_counter() - start
    ttfts = [first[str(i)] - r.arrival for i, r in enumerate(requests)]
    e2es = [done[str(i)] - r.arrival for i, r in enumerate(requests)]
    graphs = " + CUDA graphs" if engine.runner.graphs is not None else ""
    row = _latency_row(f"kvlib (paged, continuous batching{graphs})", sum(r.max_tokens for r in requests), elapsed,
                       ttfts, e2es)
    row.update(_fields(placement), preemptions=llm.metrics.num_preemptions, profile=profile.shares())
    return row


class FirstTokenTimer:
    """A ``generate`` streamer that notes when the first new tokens arrive (its first call is the prompt)."""

    def __init__(self):
        self.calls, self.first_token = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token = time.perf_counter()

    def end(self) -> None:
        pass


def run_transformers(folder: Path, requests: list[Request], budget_tokens: int,
                     placement: Placement | None = None) -> dict:
    """transformers' row, its model and every batch on ``placement``'s device in its dtype."""
    import transformers
    placement = placement or Placement.auto()
    device = placement.device
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=placement.dtype).to(device).eval()
    batch_size = max(1, budget_tokens // max(len(r.prompt) + r.max_tokens for r in requests))
    pad = 0
    model.generate(torch.tensor([requests[0].prompt], device=device), max_new_tokens=2, do_sample=False,
                   pad_token_id=pad)  # warm-up
    start, queue, ttfts, e2es = time.perf_counter(), list(requests), [], []
    while queue:
        now = time.perf_counter() - start
        if queue[0].arrival > now:
            time.sleep(queue[0].arrival - now)
            now = queue[0].arrival
        batch = [r for r in queue if r.arrival <= now][:batch_size]
        del queue[:len(batch)]
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in batch], device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=device)
        new = max(r.max_tokens for r in batch)
        timer = FirstTokenTimer()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad, streamer=timer)
        end = time.perf_counter() - start
        ttfts.extend(timer.first_token - start - r.arrival for r in batch)
        e2es.extend(end - r.arrival for r in batch)
    elapsed = time.perf_counter() - start
    row = _latency_row(f"transformers generate (static batches of {batch_size})",
                       sum(r.max_tokens for r in requests), elapsed, ttfts, e2es)
    row.update(_fields(placement), preemptions=0)
    return row


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvlib bench engine``."""
    parser = argparse.ArgumentParser(prog="kvlib bench engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default, smollm2-135m, or a Hugging Face model folder")
    parser.add_argument("--requests", type=int, default=48, help="requests in the workload")
    parser.add_argument("--scale", type=float, default=0.25, help="multiply the length mix by this")
    parser.add_argument("--rate", type=float, default=200.0, help="arrivals per second (the default saturates both engines)")
    parser.add_argument("--budget", type=int, default=4096, help="KV memory budget in token slots")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (kvlib)")
    parser.add_argument("--compare-graphs", action="store_true",
                        help="on a GPU, also serve with decode graphs off (kvlib launches every kernel)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="serve the workload this many times with each engine, in turns, and keep each engine's "
                             "fastest run (on a shared machine, the one least slowed by other work)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    folder = resolve_model_folder(args.model)
    requests = make_workload(args.requests, args.scale, args.rate, ModelConfig.from_folder(folder).vocab_size)
    placement = Placement.auto()
    runs = [lambda: run_transformers(folder, requests, args.budget, placement),
            lambda: run_kvlib(folder, requests, args.budget, args.block_size, placement=placement)]
    if args.compare_graphs and torch.cuda.is_available():
        runs.append(lambda: run_kvlib(folder, requests, args.budget, args.block_size, cuda_graphs=False,
                                      placement=placement))
    results = [[run() for run in runs] for _ in range(args.repeats)]
    rows = [max((r[i] for r in results), key=lambda row: row["output tokens/s"]) for i in range(len(runs))]
    profiles = [{"engine": row["engine"], **row.pop("profile")} for row in rows[1:]]
    for row in rows:
        row["x transformers"] = row["output tokens/s"] / rows[0]["output tokens/s"]
    best = f", fastest of {args.repeats} runs each, in turns" if args.repeats > 1 else ""
    print(format_table(rows, f"{len(requests)} requests at {args.rate}/s, lengths x{args.scale}, "
                             f"KV budget {args.budget} token slots, model {args.model} ({folder.name}), "
                             f"both engines on {placement.describe()}, {torch.get_num_threads()} thread(s){best}"))
    print()
    print(format_table(profiles, "kvlib's steps: share of their time in each part (attention is within forward)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
