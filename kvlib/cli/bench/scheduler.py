"""``kvlib bench scheduler``: time spent scheduling one step, without the model.

The scheduler runs on the host between GPU steps, so its time is pure overhead. The benchmark
drives the real :class:`~kvlib.core.scheduler.Scheduler` through decode steps of many running
sequences with the model-free driver (``kvlib.core.model_free``), which records every step
through the same ``postprocess`` the engine uses, and reports milliseconds per step: the median
over repeated runs of each run's mean. The model, sampling and tensor building are left out on
purpose.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Optional

from kvlib.core.model_free import ModelFreeEngine
from kvlib.cli.bench.report import format_table
from kvlib.core.model_free import Request
from kvlib.config import EngineConfig


def time_scheduler(num_seqs: int, prompt_len: int = 128, steps: int = 64, block_size: int = 16,
                   enable_prefix_caching: bool = False, pressure: bool = False, repeats: int = 5) -> dict:
    """Milliseconds per ``schedule()`` call with ``num_seqs`` decoding sequences.

    Each of ``repeats`` runs serves the same workload from scratch; the row gives the median of the
    runs' means (one run's mean moves with whatever else the machine does) and the p99 of all steps.
    ``pressure`` sizes the pool so sequences outgrow it and preemption runs inside the timed steps.
    """
    runs = [_timed_steps(num_seqs, prompt_len, steps, block_size, enable_prefix_caching, pressure)
            for _ in range(repeats)]
    every_step = sorted(t for timings, _ in runs for t in timings)
    return {"running seqs": num_seqs, "prefix caching": enable_prefix_caching, "pool pressure": pressure,
            "ms/step": statistics.median(statistics.mean(timings) for timings, _ in runs) * 1e3,
            "ms/step p99": every_step[int(0.99 * (len(every_step) - 1))] * 1e3,
            "preemptions": runs[0][1], "target ms": 1.0}


def _timed_steps(num_seqs: int, prompt_len: int, steps: int, block_size: int, enable_prefix_caching: bool,
                 pressure: bool) -> tuple[list[float], int]:
    """One run: the seconds of each decode step's ``schedule()``, and the preemptions it made."""
    per_seq = -(-(prompt_len + steps) // block_size)
    num_blocks = num_seqs * per_seq * (2 if not pressure else 1) - (num_seqs // 4 if pressure else 0)
    config = EngineConfig(block_size=block_size, num_gpu_blocks=num_blocks, num_cpu_blocks=num_blocks,
                          max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * prompt_len,
                          enable_prefix_caching=enable_prefix_caching, preemption_mode="swap", watermark=0.0)
    engine = ModelFreeEngine(config)
    for i in range(num_seqs):
        engine.add(f"r{i}", Request([(i + t) % 1000 for t in range(prompt_len)], steps + 1, arrival=i))
    timings = []
    for step in range(steps + 1):
        engine.step()
        if step > 0:  # step 0 is the prefill admission of everyone
            timings.append(engine.last_schedule_seconds)
    return timings, engine.metrics.num_preemptions


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvlib bench scheduler``."""
    parser = argparse.ArgumentParser(prog="kvlib bench scheduler", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed in each run")
    parser.add_argument("--repeats", type=int, default=5, help="runs per row; the row gives their median")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    rows = [time_scheduler(n, steps=args.steps, repeats=args.repeats) for n in (32, 256)]
    rows.append(time_scheduler(256, steps=args.steps, enable_prefix_caching=True, repeats=args.repeats))
    rows.append(time_scheduler(256, steps=args.steps, pressure=True, repeats=args.repeats))
    print(format_table(rows, "scheduler time per decode step (no model)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
