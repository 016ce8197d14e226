"""Cost-model figures measured on real machines, dated and named, so a lesson can show them beside its own.

Record a run on the machine itself (a GPU, say) with::

    kvlib record-run --name "H200 SXM, <where>"

It measures the cost model as ``preemption_mode="auto"`` does at start-up, times victims both ways
and returning conversations both ways with the same functions the lessons use, and appends the
result to ``kvlib/course/data/measured_costs.json``. Lessons 07 and 09 plot every recorded run.

The GPU check (``bash tools/gpu_check.sh``) measures the same run on the built-in model among its
parts; ``import_gpu_check`` takes its results file and adds that run to ``runs``, and the check's
figures and targets, as one entry of ``gpu_checks``, so one GPU run fills both.
"""
from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvlib import LLM, EngineConfig
from kvlib.core.cost_model import PreemptionCostModel
from kvlib.runner.cost_probe import ReturningTiming, VictimTiming, time_returning_turns, time_victims

RUNS_PATH = Path(__file__).resolve().parent / "data" / "measured_costs.json"
VICTIM_LENGTHS = [16, 64, 256, 1024, 4096]
RETURNING_CONTEXTS = [64, 256, 1024, 4096]
NEW_TOKENS = 40  # a returning turn's reply and new text, as in lesson 09
BATCH = 4  # decode sequences a recomputed victim joins


@dataclass
class MeasuredRun:
    name: str
    date: str  # ISO date of the run
    device: str
    model: str
    dtype: str
    block_size: int
    block_bytes: int
    threads: int  # torch's thread count during the run
    torch_version: str
    cost_model: PreemptionCostModel  # measured as auto mode measures it
    batch: int
    victims: list[VictimTiming]
    new_tokens: int
    returning: list[ReturningTiming]

    @classmethod
    def from_dict(cls, raw: dict) -> "MeasuredRun":
        return cls(**{**raw, "cost_model": PreemptionCostModel(**raw["cost_model"]),
                      "victims": [VictimTiming(**v) for v in raw["victims"]],
                      "returning": [ReturningTiming(**r) for r in raw["returning"]]})


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


def measure_run(name: str, model: str = "smollm2-135m", block_size: int = 16, victim_lengths=None,
                contexts=None) -> MeasuredRun:
    """Measure this machine: the engine's own probe, then victims and returning turns in its pools."""
    victim_lengths = VICTIM_LENGTHS if victim_lengths is None else victim_lengths
    contexts = RETURNING_CONTEXTS if contexts is None else contexts
    blocks = 2 * (max([*victim_lengths, *contexts]) + NEW_TOKENS) // block_size + 64
    llm = LLM(model, EngineConfig(block_size=block_size, num_gpu_blocks=blocks, num_cpu_blocks=blocks,
                                  preemption_mode="auto"), verbose=False)
    engine, runner = llm.engine, llm.engine.runner
    return MeasuredRun(name=name, date=datetime.date.today().isoformat(), device=device_name(engine.device),
                       model=model, dtype=str(engine.dtype).removeprefix("torch."), block_size=block_size,
                       block_bytes=runner.spec.block_bytes, threads=torch.get_num_threads(),
                       torch_version=torch.__version__, cost_model=engine.cost_model, batch=BATCH,
                       victims=time_victims(runner, list(victim_lengths), batch=BATCH), new_tokens=NEW_TOKENS,
                       returning=time_returning_turns(runner, list(contexts), NEW_TOKENS))


def load_runs(path: Path = RUNS_PATH) -> list[MeasuredRun]:
    return [MeasuredRun.from_dict(raw) for raw in json.loads(Path(path).read_text())["runs"]]


def save_run(run: MeasuredRun, path: Path = RUNS_PATH) -> None:
    """Append ``run`` to the file of recorded runs."""
    raw = json.loads(Path(path).read_text())
    raw["runs"].append(asdict(run))
    Path(path).write_text(json.dumps(raw, indent=2) + "\n")


def import_gpu_check(results_path: Path, path: Path = RUNS_PATH) -> int:
    """Add a GPU check's results (``gpu_check.jsonl``, one JSON record a line) to the file of recorded runs: its
    measured run to ``runs``, its preflight, figures, failed checks and targets to ``gpu_checks``. Returns how
    many runs it added."""
    records = [json.loads(line) for line in Path(results_path).read_text().splitlines() if line.strip()]
    kinds = {kind: [r for r in records if r.get("kind") == kind] for kind in
             ("preflight", "figure", "error", "part", "measured_run")}
    if not kinds["preflight"]:
        raise ValueError(f"{results_path} holds no preflight record: it is not a GPU check's results file")
    runs = [MeasuredRun.from_dict(r["run"]) for r in kinds["measured_run"]]
    raw = json.loads(Path(path).read_text())
    raw["runs"].extend(asdict(run) for run in runs)
    from kvlib.cli.gpu_parts import targets  # read from the figures: a check cut short has no summary
    raw.setdefault("gpu_checks", []).append({
        "preflight": kinds["preflight"][0], "parts": kinds["part"], "figures": kinds["figure"],
        "errors": kinds["error"], "targets": targets(records)})
    Path(path).write_text(json.dumps(raw, indent=2) + "\n")
    return len(runs)
