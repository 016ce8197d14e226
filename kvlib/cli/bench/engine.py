"""``kvlib bench engine``: kvlib against transformers' best batching at exactly the same KV slots.

Same model (the same safetensors folder: ``--model default``, ``smollm2-135m`` or a folder), same
workload, same number of KV token slots for every engine:

- the workload is the ShareGPT-like length mix of :mod:`kvlib.cli.bench.workloads`, scaled down by
  ``--scale`` so it runs on a CPU, arriving as a Poisson process at ``--rate`` requests/s;
- kvlib gets a paged pool of ``slots`` token slots (``--budget`` rounded down to whole blocks) and
  serves requests as they arrive (continuous batching);
- transformers' static batching gets the same slots: a batch starts when the previous one ends and
  takes arrived requests in order while its padded size (rows times its longest prompt plus its
  longest output) fits the slots, up to a row cap. The cap (powers of two up to what fits, or
  ``--static-rows``) and the cache (dynamic or static) are tuned first, one run each, and the
  fastest enters the rounds: the strongest static batching these slots allow, not one picked to lose;
- transformers' own paged continuous batching (``generate_batch``'s manager, where the installed
  transformers has it) gets a paged cache of exactly the same slots in blocks of kvlib's size, and
  the requests as they arrive.

All run on the same device in the same dtype, those kvlib picks for itself (``device="auto"``,
``dtype="auto"``: bfloat16 on a recent GPU, float32 on a CPU): a transformers baseline left in
float32 on the host would say nothing about kvlib on a GPU.

Every engine first serves a short untimed warm-up (the first requests, cut to a few tokens), so that
no timed pass pays for compiling kernels or allocating what a first batch needs; then the workload
``--rounds`` times, the engines in turns within each round (the order reversed every other round),
so a machine shared with other work slows all of them alike.
The report gives each engine's median output tokens/s with its min-max, its TTFT, end-to-end and
inter-token latency (ITL: every gap between two consecutive tokens of a request, timed as each
engine hands its tokens over), kvlib's ratio against each baseline paired round by round (median,
min-max), and the headline against the strongest baseline.
Every engine counts only the tokens each request asked for (end of sequence ignored), and each
baseline's greedy tokens are compared with kvlib's request by request. A second table says where
kvlib's steps spent their time.

On a GPU, ``--compare-graphs`` also serves with kvlib's CUDA graphs off.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from kvlib.cli.bench.engine_baselines import PagedBatches, StaticBatches, has_paged_batching, load_transformers
from kvlib.cli.bench.engine_workload import (Placement, Request, Served, make_workload, placement_fields,
                                             require_fits, serve_as_they_arrive, served_row)
from kvlib.cli.bench.report import format_table
from kvlib.config import EngineConfig, SamplingParams
from kvlib.llm import LLM
from kvlib.model.catalog import resolve_model_folder
from kvlib.model.config import ModelConfig

__all__ = ["Placement", "Request", "compare", "main", "make_workload", "run_kvlib", "run_transformers"]
WARM_UP_REQUESTS, WARM_UP_TOKENS = 4, 4  # the untimed pass each engine serves first


class StepProfile:
    """Seconds an engine's steps spend in each of their parts, gathered by wrapping the parts' methods."""

    PARTS = ("scheduling", "block moves", "forward", "attention", "sampling")

    def __init__(self, engine):
        self.reset()
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

    def reset(self) -> None:
        self.seconds, self.step_seconds = dict.fromkeys(self.PARTS, 0.0), 0.0

    def shares(self) -> dict:
        """Percent of the steps' time in each part (attention is part of the forward pass)."""
        total = self.step_seconds or 1.0
        shares = {f"{part} %": 100 * seconds / total for part, seconds in self.seconds.items()}
        shares["other %"] = 100 - sum(v for k, v in shares.items() if k != "attention %")
        return shares


class KvlibServer:
    """kvlib built once with a pool of ``slots`` token slots; each ``serve`` is one pass over a workload."""

    def __init__(self, folder: Path, slots: int, block_size: int, cuda_graphs: bool = True,
                 placement: Placement | None = None):
        self.placement = placement or Placement.auto()
        config = EngineConfig(block_size=block_size, num_gpu_blocks=slots // block_size, max_num_seqs=256,
                              preemption_mode="recompute", **placement_fields(self.placement))
        self.llm = LLM(folder, config, verbose=False)
        self.slots, self.max_batch_tokens = config.num_gpu_blocks * block_size, config.max_num_batched_tokens
        if not cuda_graphs:
            self.llm.engine.runner.set_decode_graphs(None)
        self.llm.generate([[3]], SamplingParams(max_tokens=2))  # warm-up
        graphs = " + CUDA graphs" if self.llm.engine.runner.graphs is not None else ""
        self.name = f"kvlib (paged, continuous batching{graphs})"
        self.profile, self.passes = StepProfile(self.llm.engine), 0

    def serve(self, requests: list[Request]) -> Served:
        """One pass; ``row["profile"]`` holds its step profile (``StepProfile.shares``)."""
        engine, arrivals = self.llm.engine, {}
        self.llm.metrics.reset()
        self.profile.reset()
        self.passes += 1

        def submit(i, r, arrival):
            params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
            engine.add_request(f"{self.passes}-{i}", r.prompt, params, arrival_time=arrival)

        def poll():
            outs, ready = engine.step(), []
            now = time.perf_counter()
            for out in outs:
                i = int(out.request_id.split("-")[1])
                times = arrivals.setdefault(i, [])
                times.extend([now] * (len(out.token_ids) - len(times)))  # the tokens this step added
                if out.finished:
                    ready.append((i, now, times, list(out.token_ids)))
            return ready
        served = serve_as_they_arrive(requests, submit, poll, engine.has_unfinished_requests)
        row = served_row(self.name, requests, served, self.slots)
        row.update(placement_fields(self.placement), preemptions=self.llm.metrics.num_preemptions,
                   profile=self.profile.shares())
        return row


def run_kvlib(folder: Path, requests: list[Request], budget_tokens: int, block_size: int,
              cuda_graphs: bool = True, placement: Placement | None = None) -> Served:
    """kvlib's row for one pass; ``row["profile"]`` holds its step profile (``StepProfile.shares``)."""
    return KvlibServer(folder, budget_tokens, block_size, cuda_graphs, placement).serve(requests)


def run_transformers(folder: Path, requests: list[Request], budget_tokens: int,
                     placement: Placement | None = None) -> Served:
    """transformers' static batches for one pass, as many rows as fit the budget at the workload's longest request,
    its model and every batch on ``placement``'s device in its dtype."""
    placement = placement or Placement.auto()
    rows = max(1, budget_tokens // max(len(r.prompt) + r.max_tokens for r in requests))
    model = load_transformers(folder, placement)
    return StaticBatches(model, budget_tokens, rows, "dynamic", placement).serve(requests)


def row_caps(requests: list[Request], slots: int) -> list[int]:
    """Static batch row caps worth trying: from as many rows as fit at the longest request to as many as fit at the
    shortest (never more than the workload's requests), by powers of two."""
    fit = min(len(requests), max(1, slots // max(len(r.prompt) + r.max_tokens for r in requests)))
    most = min(len(requests), max(fit, slots // min(len(r.prompt) + r.max_tokens for r in requests)))
    return sorted({fit, most} | {2 ** k for k in range(most.bit_length()) if fit <= 2 ** k <= most})


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare(folder: Path, requests: list[Request], budget: int, block_size: int, rounds: int,
            placement: Placement | None = None, caches: tuple[str, ...] = ("dynamic", "static"),
            compare_graphs: bool = False, static_rows: Optional[Sequence[int]] = None,
            served: Optional[Callable[[str, str, Served], None]] = None,
            progress: Callable[[str], None] = lambda step: None) -> dict:
    """Tunes transformers' static batching, then serves the workload ``rounds`` times with every engine in turns.
    The tuning runs once per cache in ``caches`` and row cap in ``static_rows`` (default: every cap ``row_caps``
    finds), so a run on a time budget can try fewer. Returns the engines (their rows of every round), kvlib's paired
    ratios against each baseline, the greedy agreement and the strongest baseline. ``served(stage, engine name,
    row)``, where given, hears of each pass as it ends (a run cut short by a time limit keeps what it had);
    ``progress(step)`` of each step as it starts, so a run cut short says where its time went."""
    placement = placement or Placement.auto()
    progress("building kvlib's engine")
    kvlib = KvlibServer(folder, budget, block_size, placement=placement)
    slots = kvlib.slots
    require_fits(requests, slots)
    rows_tried = row_caps(requests, slots) if static_rows is None else list(static_rows)
    if not caches or not rows_tried or min(rows_tried) < 1:
        raise ValueError(f"the static baseline needs at least one cache and row caps of at least 1 to tune over, "
                         f"got caches {list(caches)} and row caps {rows_tried}")
    kvlib_engines = [kvlib] + ([KvlibServer(folder, budget, block_size, cuda_graphs=False, placement=placement)]
                               if compare_graphs and torch.cuda.is_available() else [])
    progress("loading transformers' model")
    model = load_transformers(folder, placement)
    tuning = [StaticBatches(model, slots, rows, cache, placement) for rows in rows_tried for cache in caches]
    paged = [PagedBatches(model, slots, block_size, kvlib.max_batch_tokens, placement)] if has_paged_batching(
        model) else []

    def serve(engine, stage: str, work: list[Request] = requests) -> Served:
        progress(f"{engine.name}: {stage}")
        row = engine.serve(work)
        if served is not None:
            served(stage, engine.name, row)
        return row
    for engine in kvlib_engines + tuning + paged:
        serve(engine, "warm-up", warm_up_requests(requests))
    # one candidate leaves nothing to choose: it enters the rounds untried (a whole pass saved)
    tuned = [(candidate, serve(candidate, "tuning")) for candidate in tuning] if len(tuning) > 1 else []
    best_static = max(tuned, key=lambda pair: pair[1]["output tokens/s"])[0] if tuned else tuning[0]
    engines = kvlib_engines + [best_static] + paged
    runs = {engine.name: [] for engine in engines}
    for k in range(rounds):
        for engine in (engines if k % 2 == 0 else engines[::-1]):
            runs[engine.name].append(serve(engine, f"round {k + 1}"))
    baselines = [e.name for e in engines if not isinstance(e, KvlibServer)]
    reference = runs[kvlib.name][0]["tokens"]
    paired = {name: _spread([a["output tokens/s"] / b["output tokens/s"] for a, b in zip(runs[kvlib.name], runs[name])])
              for name in baselines}
    strongest = max(baselines, key=lambda name: statistics.median(r["output tokens/s"] for r in runs[name]))
    return {"slots": slots, "rounds": rounds, "placement": placement, "kvlib": kvlib.name, "runs": runs,
            "tuning": [{"engine": c.name, "output tokens/s": row["output tokens/s"], "KV slots": row["KV slots"]}
                       for c, row in tuned],
            "paired": paired, "strongest": strongest,
            "agree": {name: sum(a == b for a, b in zip(reference, runs[name][0]["tokens"])) for name in baselines}}


def warm_up_requests(requests: list[Request]) -> list[Request]:
    """The first ``WARM_UP_REQUESTS`` requests, all arrived at once and cut to ``WARM_UP_TOKENS`` tokens: a pass
    that pays for compiling kernels and for a first batch's allocations, which a timed pass would otherwise pay."""
    return [Request(0.0, r.prompt, min(r.max_tokens, WARM_UP_TOKENS)) for r in requests[:WARM_UP_REQUESTS]]


def _median_measured(runs: list[dict], key: str) -> Optional[float]:
    """The median over the rounds, or None when some round could not measure it."""
    values = [r[key] for r in runs]
    return None if None in values else statistics.median(values)


def summary_rows(report: dict) -> list[dict]:
    """One row per engine: medians over the rounds with min-max, slots, greedy agreement, kvlib's paired ratio, and
    notes on what a row could not measure."""
    rows = []
    for name, runs in report["runs"].items():
        speed = _spread([r["output tokens/s"] for r in runs])
        row = {"engine": name, "output tokens/s": speed["median"], "min-max": f"{speed['min']:.1f}-{speed['max']:.1f}",
               **{key: _median_measured(runs, key) for key in ("TTFT p50 s", "E2E p50 s", "E2E p99 s", "ITL p50 s",
                                                               "ITL p99 s")},
               "KV slots": runs[0]["KV slots"]}
        if name in report["paired"]:
            ratio = report["paired"][name]
            row["greedy = kvlib"] = f"{report['agree'][name]}/{len(runs[0]['tokens'])}"
            row["kvlib x it"] = f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}]"
        notes = dict.fromkeys(r[key] for r in runs for key in ("KV slots note", "ITL note") if key in r)
        if notes:
            row["notes"] = "; ".join(notes)
        rows.append(row)
    return rows


def headline(report: dict) -> str:
    ratio, name = report["paired"][report["strongest"]], report["strongest"]
    return (f"kvlib: {ratio['median']:.2f}x [{ratio['min']:.2f}-{ratio['max']:.2f}] the strongest baseline, {name} "
            f"(median and min-max of {report['rounds']} paired rounds, every engine at {report['slots']} KV slots)")


def _row_caps_option(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvlib bench engine``; the defaults run in a minute or two on a 2-core CPU."""
    parser = argparse.ArgumentParser(prog="kvlib bench engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default, smollm2-135m, or a Hugging Face model folder")
    parser.add_argument("--requests", type=int, default=32, help="requests in the workload")
    parser.add_argument("--scale", type=float, default=0.25, help="multiply the length mix by this")
    parser.add_argument("--rate", type=float, default=200.0,
                        help="arrivals per second (the default saturates every engine)")
    parser.add_argument("--budget", type=int, default=4096, help="KV token slots every engine gets (whole blocks)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV block (kvlib and transformers' paged cache)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="passes over the workload per engine, the engines in turns (more on a busy machine)")
    parser.add_argument("--static-caches", default="dynamic,static",
                        help="transformers generate caches to tune the static baseline over, comma-separated")
    parser.add_argument("--static-rows", type=_row_caps_option, default=None,
                        help="row caps to tune the static baseline over, comma-separated (default: powers of two "
                             "from as many rows as fit at the longest request to as many as fit at the shortest)")
    parser.add_argument("--compare-graphs", action="store_true",
                        help="on a GPU, also serve with decode graphs off (kvlib launches every kernel)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    folder = resolve_model_folder(args.model)
    requests = make_workload(args.requests, args.scale, args.rate, ModelConfig.from_folder(folder).vocab_size)
    report = compare(folder, requests, args.budget, args.block_size, args.rounds,
                     caches=tuple(args.static_caches.split(",")), compare_graphs=args.compare_graphs,
                     static_rows=args.static_rows)
    print(format_table(summary_rows(report), f"{len(requests)} requests at {args.rate}/s, lengths x{args.scale}, "
                       f"{report['slots']} KV token slots each, model {args.model} ({folder.name}), kvlib and "
                       f"transformers, both engines on {report['placement'].describe()}, {torch.get_num_threads()} "
                       f"thread(s), medians of {args.rounds} interleaved rounds"))
    print()
    print(headline(report))
    print()
    if report["tuning"]:
        print(format_table(report["tuning"], "transformers static batching, tuned first (one run each): the fastest "
                                             "enters the rounds"))
    else:
        print("transformers static batching: one row cap and one cache asked for, so nothing to tune")
    print()
    profiles = [{"engine": name, **runs[0]["profile"]} for name, runs in report["runs"].items() if "profile" in runs[0]]
    print(format_table(profiles, "kvlib's steps, first round: share of their time in each part "
                                 "(attention is within forward)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
