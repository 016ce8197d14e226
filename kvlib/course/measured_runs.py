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
import re
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


# What a recorded figure means, for every place that shows one (lessons 03, 07 and 09, BENCHMARKS.md).

MODEL_NAMES = {"default": "the built-in model"}
# The decode bench (``kvlib bench kernels``) of the first GPU check did not record its block size or heads:
# these are its constants then; a figure that records them overrides them.
DECODE_BENCH = {"block_size": 16, "heads": "32 query heads over 8 KV heads of 128", "dtype": "bfloat16"}


def model_name(model: str) -> str:
    return MODEL_NAMES.get(model, model)


def run_label(run: MeasuredRun) -> str:
    """Device, shape (model, dtype, the decode batch a victim joins, block size) and date: a recorded run's
    figures are only comparable with that said beside them."""
    batch = f"decode batch of {run.batch}" if run.batch else "no decode batch"
    return f"{run.device}, {model_name(run.model)} in {run.dtype}, {batch}, blocks of {run.block_size}, {run.date}"


def model_key(model: str) -> tuple[str, str | None]:
    """A model's family and size ("llama", "8b"): Llama-3-8B and a llama-3.1-8b-shaped run share their shapes."""
    name = model.lower()
    family = re.match(r"[a-z]*", name).group()
    size = re.search(r"(\d+(?:\.\d+)?[bm])(?![a-z])", name)
    return family, size.group(1) if size else None


def has_measurement(gpu: str, model: str, runs: list[MeasuredRun]) -> bool:
    """Whether a recorded run measured ``model``'s shape on ``gpu`` (a profile's name, "H200 SXM 141GB"): a lesson
    then shows the measurement instead of the line modelled from published peaks."""
    return any(on_chip(gpu, run.device) and model_key(run.model) == model_key(model) for run in runs)


def on_chip(gpu: str, device: str) -> bool:
    """Whether a device name ("NVIDIA H200") is the chip of a profile's name ("H200 SXM 141GB"; not "GH200 144GB")."""
    return re.search(rf"\b{re.escape(gpu.split()[0].upper())}\b", device.upper()) is not None


HIDDEN = "neither: both hidden"  # no cost clear of zero either way, as beside a decode pass that hides them
UNDECIDED = "undecided: swap not clear of 0"  # a swap no costlier than the decode pass it ran beside
NOT_CLEAR = "not clear of 0"  # how a table shows a cost that came out at or below zero


def clear_of_zero(seconds: float | None, noise_seconds: float = 0.0) -> bool:
    """Whether a measured cost stands out: timed (not None) and above zero and the noise (what identical decode
    passes timed beside it differed by)."""
    return seconds is not None and seconds > max(noise_seconds, 0.0)


def cheaper(swap_seconds: float, recompute_seconds: float | None, noise_seconds: float = 0.0) -> str:
    """The cheaper way to preempt. A recompute not clear of zero costs nothing. A swap timed beside a decode pass is
    what it added to the pass, floored at 0: a swap not clear of zero decides nothing (moving blocks over a host link
    is never free); with both at nothing, neither is cheaper."""
    recompute = recompute_seconds if clear_of_zero(recompute_seconds, noise_seconds) else 0.0
    if not clear_of_zero(swap_seconds, noise_seconds):
        return HIDDEN if recompute == 0 else UNDECIDED
    return "swap" if swap_seconds < recompute else "recompute"


def way(victim: VictimTiming) -> str:
    """The cheaper way to preempt ``victim``, judged against the noise of the run that timed it."""
    return cheaper(victim.swap_seconds, victim.recompute_seconds, victim.noise_seconds)


def decided(victims: list[VictimTiming]) -> list[VictimTiming]:
    """The victims whose timings name a cheaper way: swap or recompute, not undecided nor both hidden."""
    return [v for v in victims if way(v) in ("swap", "recompute")]


def shown_ms(seconds: float | None, noise_seconds: float = 0.0) -> float | str:
    """A cost in milliseconds for a table, or "not clear of 0" where it came out at or below the noise (or None)."""
    return seconds * 1e3 if clear_of_zero(seconds, noise_seconds) else NOT_CLEAR


def victim_rows(run: MeasuredRun) -> list[dict]:
    """One row per victim the run preempted both ways: what each way cost, and which was cheaper."""
    return [{"victim tokens": v.num_tokens, "swap ms": shown_ms(v.swap_seconds, v.noise_seconds),
             "recompute ms": shown_ms(v.recompute_seconds, v.noise_seconds), "cheaper": way(v)} for v in run.victims]


def crossover(run: MeasuredRun) -> int | None:
    """The smallest victim (tokens) that swapping preempted more cheaply than recomputing; None if none."""
    return next((v.num_tokens for v in sorted(run.victims, key=lambda v: v.num_tokens)
                 if way(v) == "swap"), None)


def at_lengths(victims: list[VictimTiming]) -> str:
    """``"recompute at 16, 64; neither: both hidden at 256"``: which way won at which lengths, in order."""
    groups: dict[str, list[str]] = {}
    for v in victims:
        groups.setdefault(way(v), []).append(f"{v.num_tokens:,}")
    return "; ".join(f"{way} at {', '.join(lengths)}" for way, lengths in groups.items())


def crossover_sentence(run: MeasuredRun) -> str:
    """What the measured victims say about swap or recompute, from their numbers, never typed by hand. Lengths where
    the swap was not clear of 0 decide nothing: the sentence is about the others and names those apart."""
    victims = sorted(run.victims, key=lambda v: v.num_tokens)
    if not victims:
        return "no victims measured"
    undecided = [v for v in victims if way(v) == UNDECIDED]
    rest = [v for v in victims if v not in undecided]
    if not undecided:
        return _sentence(victims, "length measured")
    lengths = ", ".join(f"{v.num_tokens:,}" for v in undecided)
    apart = f"undecided at {lengths} tokens, where the swap was not clear of 0"
    return f"{_sentence(rest, 'decided length')}; {apart}" if rest else apart


def _sentence(victims: list[VictimTiming], lengths: str) -> str:
    """The crossover sentence over ``victims`` (sorted, each decided or hidden), ``lengths`` naming what they are."""
    first, longest = next((v.num_tokens for v in victims
                           if way(v) == "swap"), None), victims[-1].num_tokens
    ways = [way(v) for v in victims]
    if first is None:
        if set(ways) == {"recompute"}:
            return f"recompute was cheaper at every {lengths}, up to {longest:,} tokens"
        return f"swap was cheaper at no {lengths}, up to {longest:,} tokens ({at_lengths(victims)})"
    below = [v for v in victims if v.num_tokens < first]
    after = [v for v in victims if v.num_tokens > first]
    if any(way(v) != "swap" for v in after):
        return f"swap was first cheaper at {first:,} tokens, but not at every longer one ({at_lengths(after)})"
    swapped = (f"swap from {first:,} up to {longest:,} tokens, the longest measured" if first != longest
               else f"swap at {first:,} tokens, the longest measured")
    if not below:
        return f"swap was cheaper at every {lengths}, {first:,} to {longest:,} tokens"
    if all(way(v) == "recompute" for v in below):
        return f"recompute was cheaper below {first:,} tokens, {swapped}"
    return f"{swapped}; below that, {at_lengths(below)}"


def recorded_lines(runs: list[MeasuredRun]) -> list[str]:
    """One line per device, model and date: which way its victims (alone and beside any decode batch) were cheaper
    at the lengths they decided, from the recorded timings. Lesson 06 prints these beside its CPU verdict."""
    groups: dict[tuple[str, str, str, int, str], list[MeasuredRun]] = {}
    for run in runs:
        groups.setdefault((run.device, model_name(run.model), run.dtype, run.block_size, run.date), []).append(run)
    lines = []
    for (device, model, dtype, block_size, date), group in groups.items():
        victims = [v for run in group for v in run.victims]
        lengths = sorted({v.num_tokens for v in victims})
        where = " and ".join(f"beside a decode batch of {run.batch}" if run.batch else "alone" for run in group)
        ways = {way(v) for v in decided(victims)}
        said = (f"{ways.pop()} was cheaper at every length decided" if len(ways) == 1 else
                "swap was cheaper at some lengths, recompute at others" if ways else "no length was decided")
        lines.append(f"{device}, {model} in {dtype}, blocks of {block_size}, {date}, victims of {lengths[0]:,} to "
                     f"{lengths[-1]:,} tokens, {where}: {said}")
    return lines


def victim_ratios(run: MeasuredRun) -> list[tuple[int, float]]:
    """``(tokens, recompute / swap)`` per victim, for a log plot: victims with a cost not clear of 0 either way (a
    swap hidden behind the decode pass, a recompute within the noise) have no ratio to plot and are left out."""
    return [(v.num_tokens, v.recompute_seconds / v.swap_seconds) for v in run.victims
            if clear_of_zero(v.swap_seconds, v.noise_seconds) and clear_of_zero(v.recompute_seconds, v.noise_seconds)]


def returning_rows(run: MeasuredRun) -> list[dict]:
    """One row per returning turn the run timed both ways (lesson 09's question)."""
    return [{"context tokens": t.context, "recompute ms": t.recompute_seconds * 1e3,
             "copy back ms": t.copy_back_seconds * 1e3,
             "cheaper": "copy back" if t.copy_back_seconds < t.recompute_seconds else "recompute"}
            for t in run.returning]


def returning_label(run: MeasuredRun) -> str:
    """Device, shape and date of a run's returning turns. They are timed alone, each turn with no decode batch beside
    it, so unlike a victim's label this one names no batch size."""
    return (f"{run.device}, {model_name(run.model)} in {run.dtype}, blocks of {run.block_size}, {run.date}, "
            f"returning turns alone")


def returning_runs(runs: list[MeasuredRun]) -> list[MeasuredRun]:
    """The runs with returning turns, each set of timings once: two runs of one shape (one with victims beside a
    decode batch, one without) carry the same returning turns and the same probe, which a lesson shows once."""
    seen, kept = set(), []
    for run in runs:
        key = (returning_label(run), run.block_bytes, run.new_tokens, json.dumps(asdict(run.cost_model)),
               tuple((t.context, t.recompute_seconds, t.copy_back_seconds) for t in run.returning))
        if run.returning and key not in seen:
            seen.add(key)
            kept.append(run)
    return kept


def returning_sentence(run: MeasuredRun) -> str:
    """Where copying a returning conversation back first beat recomputing it, from the timed turns."""
    rows = sorted(returning_rows(run), key=lambda r: r["context tokens"])
    if not rows:
        return "no returning turns timed"
    first = next((r["context tokens"] for r in rows if r["cheaper"] == "copy back"), None)
    if first is None:
        return f"recomputing was cheaper at every context timed, up to {rows[-1]['context tokens']:,} tokens"
    return f"copying back was first cheaper at {first:,} tokens of context (timed up to {rows[-1]['context tokens']:,})"


def load_gpu_checks(path: Path = RUNS_PATH) -> list[dict]:
    """Every GPU check recorded, oldest first: preflight, parts, figures, errors and targets."""
    return json.loads(Path(path).read_text()).get("gpu_checks", [])


def check_label(check: dict) -> str:
    """The device and date of a GPU check, as every figure of it is labelled, and its commit where it is known:
    two checks of one day on one device are told apart by what they ran."""
    preflight = check["preflight"]
    capability = f" (sm_{preflight['capability'].replace('.', '')})" if preflight.get("capability") else ""
    commit = f", at {preflight['commit']}" if preflight.get("commit") else ""
    return f"{preflight['device']}{capability}, {preflight['date'][:10]}{commit}"


def figures(check: dict, name: str) -> list[dict]:
    return [f for f in check.get("figures", []) if f.get("figure") == name]


DECODE_FIGURES = ("decode bandwidth", "decode sweep")  # the first check's bench, then the sweep over tunings


def tile_length(figure: dict):
    """A Triton kernel's ``BLOCK_N``; torch's SDPA has none of its own, whatever the run set for Triton."""
    return "-" if str(decode_kernel(figure)).startswith("torch") else figure.get("block_n") or "-"


def decode_kernel(figure: dict) -> str:
    return figure.get("variant", figure.get("kernel"))


def decode_row(check: dict, figure: dict) -> dict:
    """One decode figure, labelled: a sweep's figures were replayed from a CUDA graph, the first bench's were not."""
    sweep = figure["figure"] == "decode sweep"
    return {"device, date": check_label(check), "dtype": figure.get("dtype", DECODE_BENCH["dtype"]),
            "batch x context": figure["shape"], "block size": figure.get("block_size", DECODE_BENCH["block_size"]),
            "heads": figure.get("heads", DECODE_BENCH["heads"]), "kernel": decode_kernel(figure),
            "splits": figure.get("splits") or "-", "BLOCK_N": tile_length(figure),
            "timed": "graph-replayed" if sweep else "eager",
            "GB/s": figure.get("graph GB/s" if sweep else "gbps"), "% of HBM peak": figure.get("value")}


def gpu_decode_rows(checks: list[dict]) -> list[dict]:
    """Every recorded decode-bandwidth figure, labelled with its device, date, shape and kernel (a variant the
    device could not run, which records an error and no figure, is left out)."""
    return [decode_row(check, f) for check in checks for name in DECODE_FIGURES for f in figures(check, name)
            if "error" not in f]


def gpu_swap_rows(checks: list[dict]) -> list[dict]:
    """Every recorded swap figure: scattered blocks against one pinned contiguous copy of the same bytes."""
    return [{"device, date": check_label(check), "direction": f["direction"], "host blocks": f["host_blocks"],
             "block": f"{f['block_size']} tokens, {f['block_kib']:g} KiB", "GB/s": f["gbps"],
             "contiguous GB/s": f["contiguous_gbps"], "% of contiguous": f["value"]}
            for check in checks for f in figures(check, "swap")]


SWAP_PATHS = (("runtime", "staged, copies issued to the CUDA runtime"), ("direct", "one direct kernel"))


def figure_shape(figure: dict) -> str:
    """The shape a figure was measured at, and what sets it apart from its siblings, from the fields it recorded."""
    if figure.get("figure") == "swap paths":
        others = "; ".join(f"{label}: {figure[f'{path} % of contiguous']:.1f}%" for path, label in SWAP_PATHS
                           if f"{path} % of contiguous" in figure)
        return (f"{figure['block KiB']:,.0f} KiB blocks, {figure['host blocks']} host blocks, {figure['direction']}, "
                f"{figure['MiB']:,.0f} MiB" + (f" ({others})" if others else ""))
    if "case" in figure:
        return f"{figure['case']}: {figure['implementation']}" + (f", {figure['tuning']}" if figure.get("tuning") else "")
    if "shape" in figure:
        batch = f", batch {figure['batch']}" if "batch" in figure else ""
        mode = f", {figure['mode']}" + (" with partial preemption" if figure.get("partial") else "") \
            if "mode" in figure else ""
        return f"{figure['shape']}{batch}{mode}"
    if "batch" in figure and "context" in figure:
        bound = f" under a {figure['bound']:,} bound" if "bound" in figure else ""
        return f"{figure['batch']} x {figure['context']:,}{bound}"
    if "asked_bytes" in figure:
        return f"a host pool of {figure['asked_bytes']:,} bytes"
    if figure.get("part") in ("engine", "throughput"):
        return "the built-in model"
    return "-"


def gpu_other_rows(checks: list[dict]) -> list[dict]:
    """The figures that are neither decode nor swap, each with its shape and unit."""
    return [{"device, date": check_label(check), "figure": f["figure"], "shape": figure_shape(f),
             "value": f["value"], "unit": f["unit"]}
            for check in checks for f in check.get("figures", [])
            if f.get("figure") not in (*DECODE_FIGURES, "swap")]


def target_rows(checks: list[dict]) -> list[dict]:
    """Each check's targets as it stated them that day: met, not met, or not measured."""
    said = {True: "met", False: "not met", None: "not measured"}
    return [{"device, date": check_label(check), "target": t["target"],
             "value": "-" if t["value"] is None else t["value"], "met": said[t["met"]]}
            for check in checks for t in check.get("targets", [])]


def markdown_table(rows: list[dict]) -> str:
    """A GitHub table of ``rows``, floats to 3 significant figures (2 decimals from 100 up)."""
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:,.2f}" if abs(value) >= 100 else f"{value:.3g}"
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value:,}"
        return "-" if value is None else str(value)
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


GPU_HEADING = "## GPU (measured, `kvlib/course/data/measured_costs.json`)"


def gpu_markdown(path: Path = RUNS_PATH) -> str:
    """BENCHMARKS.md's GPU section, written from the recorded checks and runs so that it cannot drift from them."""
    checks, runs = load_gpu_checks(path), load_runs(path)
    parts = [GPU_HEADING, "",
             "Written by `kvlib.course.measured_runs.gpu_markdown()` from the committed file; "
             "`tests/test_measured_runs.py` checks that this section is what it writes. Every row names its device "
             "and date, and its shape."]
    if not checks and not runs:
        return "\n".join(parts + ["", "No GPU run is recorded yet."]) + "\n"
    for check in checks:
        p = check["preflight"]
        parts += ["", f"GPU check on {check_label(check)}: torch {p['torch']}, CUDA {p['cuda']}, Triton {p['triton']}, "
                      f"Python {p['python']}."]
    sections = [("Targets, as each check stated them that day", target_rows(checks)),
                ("Decode bandwidth (`kvlib bench kernels`, one layer's paged K/V, random data)",
                 gpu_decode_rows(checks)),
                ("Swap: scattered blocks against one pinned contiguous copy (`kvlib bench swap`)",
                 gpu_swap_rows(checks)),
                ("Other figures", gpu_other_rows(checks))]
    for title, rows in sections:
        if rows:
            parts += ["", f"### {title}", "", markdown_table(rows)]
    for run in runs:
        parts += ["", f"### Victims both ways: {run_label(run)}", "", markdown_table(victim_rows(run)), "",
                  f"Measured: {crossover_sentence(run)}."]
    for run in returning_runs(runs):
        parts += ["", f"### Returning turns both ways: {returning_label(run)}", "", markdown_table(returning_rows(run)),
                  "", f"Returning turns of {run.new_tokens} new tokens: {returning_sentence(run)}."]
    return "\n".join(parts) + "\n"
