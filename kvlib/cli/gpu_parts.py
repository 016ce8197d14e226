"""The parts of ``tools/gpu_check.py``, each run as ``python -m kvlib.cli.gpu_parts PART RESULTS`` on a GPU.

A part appends one JSON line per figure to the results file as soon as it has it (a part killed
by its timeout keeps what it measured), and exits non-zero when any of its checks failed.
``targets`` reads the records back and says, per target, met, not met, or not measured. The parts
at real model shapes are in :mod:`kvlib.cli.gpu_real_parts`, the built-in model's engine checks in
:mod:`kvlib.cli.gpu_engine_check`.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from kvlib.cli.gpu_real_parts import PARTS as REAL_PARTS

DECODE_TARGET = 85.0  # % of the device's HBM peak
SWAP_TARGET = 85.0  # % of one pinned contiguous copy of the same bytes
ENGINE_TARGET = 1.5  # x transformers' strongest batching, output tokens per second
GRAPH_SPLIT_TARGET = 1.1  # a decode under a 131,072-token bound, against its real bound: at most this much slower
SWAP_BLOCK_SIZES = (4, 16, 64)  # tokens per block of a Llama-3-8B-shaped KV block (128 KiB each)
SPLIT_CASE = (8, 4096, 131072)  # batch, context, the bound a decode graph is captured with


class Results:
    """Appends records to the results file, one JSON line each, flushed at once."""

    def __init__(self, path: Path | str, part: str):
        self.path, self.part = Path(path), part

    def add(self, figure: str, value, unit: str, **fields) -> None:
        self.write({"kind": "figure", "part": self.part, "figure": figure, "value": value, "unit": unit, **fields})

    def progress(self, step: str, **fields) -> None:
        """A step starting: where a part's time went when its limit cuts it short."""
        self.write({"kind": "progress", "part": self.part, "step": step, **fields})

    def error(self, check: str, error: BaseException) -> None:
        self.write({"kind": "error", "part": self.part, "check": check, "error": f"{type(error).__name__}: {error}"})

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        print(json.dumps(record, default=str), flush=True)


def part_decode(out: Results) -> bool:
    """Decode over a grid of split counts and tunings per shape, eager and replayed from a CUDA graph (as the
    engine replays it), against torch SDPA over a contiguous cache timed the same ways."""
    from kvlib.cli.bench.kernels import DEFAULT_DECODE_TUNING, decode_sweep
    for row in decode_sweep():
        tuning = (row.get("block_n"), row.get("num_warps"), row.get("num_stages"))
        engine_default = row["variant"].endswith("(the rule's count)") and tuning == DEFAULT_DECODE_TUNING
        out.add("decode sweep", row.get("graph % of peak"), "% of HBM peak, graph-replayed",
                engine_default=engine_default, **row)
    return True


def part_prefill(out: Results) -> bool:
    """Chunked-prefill attention in TFLOP/s per tuning against SDPA's fused path."""
    from kvlib.cli.bench.kernels import prefill_bench
    for row in prefill_bench():
        out.add("prefill attention", row.get("TFLOP/s"), "TFLOP/s", **row)
    return True


def part_graph_split(out: Results) -> bool:
    """A decode graph captured with a 131,072-token bound over 4k-token contexts, against one with their own."""
    from kvlib.cli.bench.kernels import NUM_KV_HEADS, decode_case, graph_ms
    from kvlib.kernels import paged_decode
    batch, context, bound = SPLIT_CASE
    paged, _, _ = decode_case(batch, context, "cuda", torch.bfloat16)
    times = {name: graph_ms([lambda max_len=max_len: paged(None, max_context_len=max_len)])
             for name, max_len in (("real", context), ("bound", bound))}
    per_sm = next((n for key, n in paged_decode._occupancy.items() if key[1] == torch.bfloat16), None)
    splits = paged_decode.choose_num_splits(batch, NUM_KV_HEADS, bound, torch.device("cuda"), per_sm)
    working = batch * NUM_KV_HEADS * paged_decode.working_splits(context, splits)
    out.add("graph split", times["bound"] / times["real"], "x the real bound's time", batch=batch, context=context,
            bound=bound, us_real=times["real"] * 1e3, us_bound=times["bound"] * 1e3, splits=splits, per_sm=per_sm,
            programs=batch * NUM_KV_HEADS * splits, working_programs=working)
    return True


def part_swap(out: Results) -> bool:
    """Swap both ways at several block sizes against one pinned contiguous copy; the bytes a host pool pins."""
    from kvlib.cli.bench.swap import block_spec, run_swap_bench
    from kvlib.runner.kv_cache import KVCachePool, torch_pinned_bytes
    from kvlib.cli.bench.swap import swap_paths_bench
    ok = True
    for row in swap_paths_bench():
        ok &= all(v for k, v in row.items() if k.endswith("copied right"))
        out.add("swap paths", row.get("staged % of contiguous"), "% of a pinned contiguous copy, staged", **row)
    for row in run_swap_bench(SWAP_BLOCK_SIZES, total_mib=256, model="llama-3-8b", device="cuda", repeats=5):
        ok &= row["copied right"]
        out.add("swap", row["% of contiguous"], "% of a pinned contiguous copy", direction=row["direction"],
                host_blocks=row["host blocks"], block_size=row["block size"], block_kib=row["block KiB"],
                gbps=row["scattered GB/s"], contiguous_gbps=row["contiguous GB/s"], copied_right=row["copied right"])
    spec = block_spec("llama-3-8b", 16, torch.bfloat16)
    start = time.perf_counter()
    pool = KVCachePool(spec, 700, "cpu", pin_memory=True)  # 1,400 MiB: torch's allocator would pin 2,048
    asked = pool.data.nbytes
    out.add("host pool pinned bytes", pool.pinned_bytes / asked, "x the pool's size", pinned_bytes=pool.pinned_bytes,
            asked_bytes=asked, torch_allocator_bytes=torch_pinned_bytes(asked),
            seconds=time.perf_counter() - start)
    return ok and pool.pinned_bytes == asked


class TestOutcomes:
    """A pytest plugin that writes each test's outcome as pytest reports it, so a part its limit cuts keeps what
    ran: a ``test`` record per test, and a failure at once as a false figure named after the test."""

    def __init__(self, out: Results):
        self.out, self.counts, self.failures = out, {}, []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "call" and report.passed:
            return  # setup and teardown are reported only when they fail or skip the test
        outcome = "error" if report.when != "call" and report.failed else report.outcome
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        self.out.write({"kind": "test", "part": self.out.part, "test": report.nodeid, "outcome": outcome,
                        "seconds": round(report.duration, 2)})
        if outcome in ("failed", "error"):
            self.failures.append(report.nodeid)
            self.out.add(f"kernel test {report.nodeid}", False, "passed", outcome=outcome,
                         error=str(report.longrepr)[-1500:])


def part_kernel_tests(out: Results) -> bool:
    """The kernel and Triton-engine tests compiled for this GPU, run in this process so each outcome is written
    as it comes (compiling every variant on a fresh machine can take past the part's limit)."""
    import pytest
    outcomes = TestOutcomes(out)
    exit_code = pytest.main(["tests/test_kernels.py", "tests/test_engine_triton.py", "-q", "-p", "no:cacheprovider",
                             "-o", "addopts=", "--maxfail=10", "-rf"], plugins=[outcomes])
    failed = outcomes.counts.get("failed", 0) + outcomes.counts.get("error", 0)
    out.add("kernel tests", failed == 0 and outcomes.counts.get("passed", 0) > 0, "all passed",
            counts=outcomes.counts, failures=outcomes.failures[:10])
    return exit_code == 0


def part_engine(out: Results) -> bool:
    from kvlib.cli.gpu_engine_check import run_engine_checks
    return run_engine_checks(out)


PARTS = {**REAL_PARTS, "decode": part_decode, "swap": part_swap, "prefill": part_prefill, "engine": part_engine,
         "graph-split": part_graph_split, "kernel-tests": part_kernel_tests}


def target(name: str, value, threshold, at_most: bool = False) -> dict:
    if value is None or threshold is None:
        return {"target": name, "value": value, "met": None}
    if isinstance(threshold, bool):
        return {"target": name, "value": None, "met": value is threshold}
    return {"target": name, "value": value, "met": value <= threshold if at_most else value >= threshold}


def targets(records: list[dict]) -> list[dict]:
    """Per target: met, not met, or not measured (``met`` None), from the figures recorded."""
    figures = [r for r in records if r.get("kind") == "figure"]

    def named(figure: str) -> list[dict]:
        return [f for f in figures if f["figure"] == figure]
    decode = [f for f in named("decode sweep") if f.get("engine_default")]
    found = [target(f"decode {f['shape']} >= {DECODE_TARGET:g}% of HBM peak (graph-replayed)", f["value"],
                    DECODE_TARGET) for f in decode] or [target(f"decode >= {DECODE_TARGET:g}% of HBM peak", None, None)]
    found += [target(f"decode {f['shape']} at least as fast as torch SDPA over a contiguous cache (graph-replayed)",
                     f.get("graph x sdpa"), 1.0) for f in decode]
    found += [target(f"graph decode under a {f['bound']:,} bound <= {GRAPH_SPLIT_TARGET:g}x its real bound's time",
                     f["value"], GRAPH_SPLIT_TARGET, at_most=True) for f in named("graph split")] or [
        target("graph decode under a long bound as fast as under its own", None, None)]
    found += [target(f"swap {f['direction']} {f['block_kib']:g} KiB blocks, {f['host_blocks']} host blocks >= "
                     f"{SWAP_TARGET:g}% of a pinned contiguous copy", f["value"], SWAP_TARGET) for f in named("swap")
              ] or [target(f"swap >= {SWAP_TARGET:g}% of a pinned contiguous copy", None, None)]
    found += [target(f"swap {f['direction']} {f['block KiB']:g} KiB blocks, scattered, staged (the engine's path) >= "
                     f"{SWAP_TARGET:g}% of a pinned contiguous copy", f["value"], SWAP_TARGET)
              for f in named("swap paths")]
    found += [target("host pool pins exactly its size", f["value"], 1.0, at_most=True)
              for f in named("host pool pinned bytes")]
    found += [target(f"engine {f['shape']}-shaped >= {ENGINE_TARGET:g}x transformers' strongest", f["value"],
                     ENGINE_TARGET) for f in named("engine")] or [
        target(f"engine >= {ENGINE_TARGET:g}x transformers' strongest", None, None)]
    found += [target(f["figure"], f["value"], True) for f in figures if isinstance(f["value"], bool)]
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in PARTS:
        print(f"usage: python -m kvlib.cli.gpu_parts {{{','.join(PARTS)}}} RESULTS_FILE", file=sys.stderr)
        return 2
    return 0 if PARTS[argv[0]](Results(argv[1], argv[0])) else 1


if __name__ == "__main__":
    raise SystemExit(main())
