"""The GPU check, in at most 9 minutes: a preflight, then each part under its own timeout, into one results file.

``bash tools/gpu_check.sh`` runs this with the machine's python3 (``PYTHON=...`` for another). It
installs nothing and assumes only the repository and a CUDA build of torch with Triton:

- the preflight (seconds) names in one line everything missing that the parts need (CUDA torch
  and a GPU, NumPy, Triton with its CUDA backend, a C compiler and ``Python.h`` for Triton's launcher,
  free device memory) and stops; what only one check needs (transformers, pytest) is noted and
  that check is recorded as not measured;
- the parts run in order of value (``PARTS``; ``--parts NAME,...`` runs those alone, in that order,
  and appends to the results file instead of starting it anew), each in its own process group under its own
  timeout, lengthened by what the parts before it left unused of theirs (``allowance``), and never past
  ``TOTAL_SECONDS`` from the start, compilation included (Triton's cache is ``.triton-cache/`` in the
  checkout, ignored by git, so a rerun on a warm machine skips it);
  a part that fails or times out is recorded and the next one runs;
- every record is one JSON line appended to ``gpu_check.jsonl`` as it happens (so a timeout keeps
  what ran): the preflight, each figure a part measures (``kvlib.cli.gpu_parts``), each part's
  outcome, and last the summary, which says per target whether it was met;
  ``kvlib.course.measured_runs.import_gpu_check`` turns the file into the first GPU rows of
  ``measured_costs.json`` (written beside the results, to commit).

The exit status is the number of parts that did not pass (2 for a failed preflight, with no part run).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOTAL_SECONDS = 530  # every part, compilation and checkpoint writing included, ends by then: within 9 minutes
KILL_GRACE = 3  # seconds between a timed-out part's SIGTERM and its SIGKILL
MIN_FREE_GIB = 8.0
RESULTS_NAME = "gpu_check.jsonl"


@dataclass(frozen=True)
class Part:
    name: str
    limit: int  # seconds
    what: str


PARTS = [  # in order of value; limits from the H200 run of 2026-12-04 on a fresh machine (compiling everything)
    Part("shapes", 40, "random-weight checkpoints of Llama-3.2-1B's and Llama-3-8B's shapes, written on the device"),
    Part("real-tokens", 45, "1B-shaped greedy tokens against transformers on the same weights, float32 and bfloat16"),
    Part("crossover", 65, "victims of 16 to 16,384 tokens swapped and recomputed for real, alone and beside decode, "
                          "per shape; the cost model auto mode measures"),
    Part("real-engine", 124, "kvlib, graphs on and off, against transformers' strongest batching at the same KV "
                             "slots, per shape: output tok/s, TTFT, inter-token p50/p99"),
    Part("preemption", 50, "1B shape: recompute, swap, auto and partial preemption in a pool a third the size "
                           "needed, against one that holds it all"),
    Part("decode", 30, "decode bandwidth against HBM peak per shape, split counts and tunings, eager and "
                       "graph-replayed, against torch SDPA over a contiguous cache"),
    Part("swap", 35, "swap, staged (torch's copies or the CUDA runtime's) and direct, at several block sizes against a pinned contiguous copy, both ways"),
    Part("prefill", 18, "chunked-prefill attention in TFLOP/s per tuning against SDPA's fused path"),
    Part("engine", 32, "built-in model: token-exact greedy vs the torch engine and transformers; swap, host tier, "
                       "n > 1; synchronizations per step; memory profile; pinned bytes; swap time"),
    Part("graph-split", 8, "decode graphs: real contexts under a 131,072-token bound against their own"),
    Part("kernel-tests", 50, "compiled kernel tests, at most 10 failures reported"),
]


def append(path: Path, record: dict) -> None:
    """One JSON line, written and flushed at once: a timeout later keeps it."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def missing_essentials(env: dict | None = None) -> tuple[list[str], dict]:
    """What the parts need and this machine lacks (empty: all there), and what the preflight found."""
    env = os.environ if env is None else env
    found: dict = {"python": sys.version.split()[0]}
    missing = []
    if importlib.util.find_spec("torch") is None:
        return ["torch (a CUDA build)"], found
    import torch
    found["torch"] = torch.__version__
    found["cuda"] = torch.version.cuda
    gpu = torch.version.cuda is not None and torch.cuda.is_available()
    if torch.version.cuda is None:
        missing.append(f"a CUDA build of torch (this one, {torch.__version__}, is CPU-only)")
    elif not gpu:
        missing.append("a visible CUDA GPU (torch.cuda.is_available() is False)")
    if importlib.util.find_spec("numpy") is None:
        missing.append("NumPy (kvlib's KV pools and kernels import it)")
    else:
        import numpy
        found["numpy"] = numpy.__version__  # Triton before 3.7 interprets kernels only beside NumPy before 2.4
    if importlib.util.find_spec("triton") is None:
        missing.append("Triton")
    else:
        import triton
        found["triton"] = triton.__version__
        if importlib.util.find_spec("triton.backends.nvidia") is None:
            missing.append("Triton's CUDA backend")
    compiler = env.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    found["compiler"] = compiler
    if not compiler:
        missing.append("a C compiler (cc, gcc or clang; Triton builds its launcher with it)")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.is_file():
        missing.append(f"Python.h ({header}; the python3-dev package)")
    if gpu:
        free, total = torch.cuda.mem_get_info()
        found.update(device=torch.cuda.get_device_name(), capability=".".join(map(str, torch.cuda.get_device_capability())),
                     free_gib=round(free / 2**30, 1), total_gib=round(total / 2**30, 1))
        if free / 2**30 < MIN_FREE_GIB:
            missing.append(f"{MIN_FREE_GIB:g} GiB of free device memory ({free / 2**30:.1f} GiB free)")
    return missing, found


def optional_missing() -> list[str]:
    """What single checks need: each is recorded as not measured where it is missing."""
    return [name for name in ("transformers", "pytest") if importlib.util.find_spec(name) is None]


def commit(root: Path = ROOT, env: dict | None = None) -> str:
    """The checkout's commit: ``$KVLIB_COMMIT`` where the caller knows it (a copy of the tree without its own
    history), else git's, but only where ``root`` is the top of its own repository: a copy inside another
    repository would otherwise record that one's head."""
    env = os.environ if env is None else env
    if env.get("KVLIB_COMMIT"):
        return env["KVLIB_COMMIT"]
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
    if top.returncode or Path(top.stdout.strip()).resolve() != Path(root).resolve():
        return "unknown (no git history of its own; set KVLIB_COMMIT)"
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def allowance(part: Part, earlier: list[Part], elapsed: float, seconds_left: float) -> float:
    """Seconds ``part`` may run: its own limit, and the time the parts before it (``earlier``, which ran in
    ``elapsed`` seconds) left unused of theirs, so the run never takes longer than its parts' limits allow;
    never more than the time left."""
    unused = sum(p.limit + KILL_GRACE for p in earlier) - elapsed
    return min(seconds_left, part.limit + max(0.0, unused))


def run_part(part: Part, command: list[str], results: Path, log: Path, seconds: float, env: dict) -> dict:
    """Run one part in its own process group for at most ``seconds``; its record."""
    limit = max(1, int(seconds))
    start = time.monotonic()
    with open(log, "a") as out:
        out.write(f"\n==== {part.name} (limit {limit} s): {part.what}\n")
        out.flush()
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            rc = process.wait(timeout=limit)
            status = "passed" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=KILL_GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            rc, status = None, "timed out"
    record = {"kind": "part", "part": part.name, "status": status, "exit": rc, "limit": limit,
              "seconds": round(time.monotonic() - start, 1), "tail": tail(log, 15)}
    append(results, record)
    return record


def tail(path: Path, lines: int) -> list[str]:
    return Path(path).read_text(errors="replace").splitlines()[-lines:]


def part_command(part: Part, results: Path, python: str = sys.executable) -> list[str]:
    return [python, "-m", "kvlib.cli.gpu_parts", part.name, str(results)]


def part_env(root: Path = ROOT) -> dict:
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
            "PYTHONUNBUFFERED": "1", "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(root / ".triton-cache")}


def print_summary(records: list[dict]) -> None:
    from kvlib.cli.gpu_parts import targets
    print("\nkvlib GPU check: targets")
    for target in targets(records):
        verdict = {True: "met", False: "NOT met", None: "not measured"}[target["met"]]
        value = "" if target["value"] is None else f" ({target['value']:.3g})"
        print(f"  {verdict:12} {target['target']}{value}")
    for record in records:
        if record["kind"] == "part":
            print(f"  part {record['part']}: {record['status']} in {record['seconds']} s")


def chosen_parts(argv: list[str]) -> list[Part]:
    """``PARTS``, or those ``--parts a,b`` names, in the order given."""
    parser = argparse.ArgumentParser(prog="bash tools/gpu_check.sh", description="kvlib's checks that need a GPU")
    parser.add_argument("--parts", help=f"comma-separated, from: {','.join(p.name for p in PARTS)}")
    args = parser.parse_args(argv)
    if not args.parts:
        return list(PARTS)
    by_name = {p.name: p for p in PARTS}
    unknown = [name for name in args.parts.split(",") if name not in by_name]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; the parts are {', '.join(by_name)}")
    return [by_name[name] for name in args.parts.split(",")]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parts = chosen_parts(argv)
    out_dir = Path(os.environ.get("OUT") or ROOT / "gpu-results")
    out_dir.mkdir(parents=True, exist_ok=True)
    results, log = out_dir / RESULTS_NAME, out_dir / "gpu_check.log"
    if len(parts) == len(PARTS) or not results.exists():
        results.write_text("")
        log.write_text("")
    start = time.monotonic()
    missing, found = missing_essentials()
    preflight = {"kind": "preflight", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "commit": commit(), "parts": [p.name for p in parts], "missing": missing,
                 "optional_missing": optional_missing(), **found}
    append(results, preflight)
    if missing:
        print(f"kvlib GPU check: missing {'; '.join(missing)}. Nothing was run.")
        return 2
    print(f"kvlib GPU check on {found['device']} ({found['free_gib']} GiB free), torch {found['torch']}, "
          f"Triton {found['triton']}; results in {results}")
    env, failed, parts_start = part_env(), 0, time.monotonic()
    for i, part in enumerate(parts):
        left = TOTAL_SECONDS - (time.monotonic() - start) - KILL_GRACE
        if left < 5:
            append(results, {"kind": "part", "part": part.name, "status": "skipped", "exit": None, "limit": 0,
                             "seconds": 0, "tail": ["no time left"]})
            failed += 1
            continue
        seconds = allowance(part, parts[:i], time.monotonic() - parts_start, left)
        record = run_part(part, part_command(part, results), results, log, seconds, env)
        print(f"  {part.name}: {record['status']} in {record['seconds']} s")
        failed += record["status"] != "passed"
    records = read_records(results)
    from kvlib.cli.gpu_parts import targets
    append(results, {"kind": "summary", "targets": targets(records), "seconds": round(time.monotonic() - start, 1)})
    print_summary(records)
    from kvlib.course.measured_runs import RUNS_PATH, import_gpu_check
    measured = out_dir / "measured_costs.json"
    shutil.copy(RUNS_PATH, measured)
    import_gpu_check(results, measured)
    print(f"\nmeasured rows, {RUNS_PATH.name} with this run added: {measured}")
    return failed


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
