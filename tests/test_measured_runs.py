"""Recorded runs: the committed file loads, a run survives saving, recording one works on this machine, and the
tables lessons and BENCHMARKS.md show from the file say what it holds."""
import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from kvlib.cli.commands import main
from kvlib.core.cost_model import PreemptionCostModel
from kvlib.course import measured_runs as mr
from kvlib.course.measured_runs import RUNS_PATH, load_runs, measure_run, save_run
from kvlib.runner.cost_probe import ReturningTiming, VictimTiming

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_runs_load_and_are_dated_and_named():
    for run in load_runs():
        assert run.name and run.date[:2] == "20" and run.device and run.victims and run.returning
        assert run.cost_model.prefill_tokens_per_s > 0


def test_a_recorded_run_round_trips(tmp_path):
    torch.set_num_threads(1)
    path = tmp_path / "runs.json"
    shutil.copy(RUNS_PATH, path)
    before = len(json.loads(path.read_text())["runs"])
    run = measure_run("this test", "default", victim_lengths=[16, 64], contexts=[64])
    save_run(run, path)
    loaded = load_runs(path)
    assert len(loaded) == before + 1 and loaded[-1] == run
    assert [v.num_tokens for v in run.victims] == [16, 64] and [t.context for t in run.returning] == [64]
    assert run.block_bytes == 16 * 4 * 2 * 2 * 32 * 4 and run.dtype == "float32" and run.batch == 4


def test_the_command_appends_to_the_file_it_is_given(tmp_path, monkeypatch, capsys):
    import kvlib.course.measured_runs as measured_runs
    path = tmp_path / "runs.json"
    shutil.copy(RUNS_PATH, path)
    monkeypatch.setattr(measured_runs, "VICTIM_LENGTHS", [16])
    monkeypatch.setattr(measured_runs, "RETURNING_CONTEXTS", [16])
    main(["record-run", "--name", "command test", "--model", "default", "--file", str(path)])
    assert load_runs(path)[-1].name == "command test" and "recorded 'command test'" in capsys.readouterr().out


# The tables lessons 03, 07 and 09 and BENCHMARKS.md show, built from data made here, so each answer is known.


def made_up_run(costs: dict[int, tuple[float, float]], batch: int = 32, returning=()) -> mr.MeasuredRun:
    """A run whose victims cost ``{tokens: (swap s, recompute s)}``."""
    cost = PreemptionCostModel(host_link_bytes_per_s=5e10, prefill_tokens_per_s=1e5, floor_seconds=1e-3)
    return mr.MeasuredRun(
        name="made up", date="2026-12-05", device="NVIDIA L4", model="llama-3.1-8b-shaped (random bfloat16 weights)",
        dtype="bfloat16", block_size=16, block_bytes=2 << 20, threads=8, torch_version="2.0", cost_model=cost,
        batch=batch, victims=[VictimTiming(n, -(-n // 16), s, r) for n, (s, r) in costs.items()], new_tokens=40,
        returning=[ReturningTiming(*t) for t in returning])


@pytest.mark.parametrize("costs, first", [
    ({16: (2.0, 1.0), 64: (2.0, 3.0), 256: (2.0, 9.0)}, 64),
    ({256: (2.0, 9.0), 16: (2.0, 1.0), 64: (2.0, 1.5)}, 256),  # out of order
    ({16: (2.0, 1.0), 64: (2.0, 1.9)}, None),
    ({16: (0.5, 1.0)}, 16),
    ({16: (0.5, None)}, None),  # a recompute not clear of zero is the cheaper way
    ({16: (0.0, -0.5), 64: (0.0, 1.0)}, None),  # a swap not clear of 0 decides nothing
    ({16: (0.0, -0.5), 64: (0.0, 1.0), 256: (0.5, 2.0)}, 256),
])
def test_the_crossover_is_the_smallest_victim_that_swapped_cheaper(costs, first):
    run = made_up_run(costs)
    assert mr.crossover(run) == first
    expected = {n: (mr.HIDDEN if r is None or r <= 0 else mr.UNDECIDED) if s <= 0 else "swap" if r is not None and s < r
                else "recompute" for n, (s, r) in costs.items()}
    assert {row["victim tokens"]: row["cheaper"] for row in mr.victim_rows(run)} == expected


def test_the_crossover_sentence_says_what_the_victims_measured():
    assert mr.crossover_sentence(made_up_run({16: (2.0, 1.0), 4096: (2.0, 1.5)})) == \
        "recompute was cheaper at every length measured, up to 4,096 tokens"
    assert mr.crossover_sentence(made_up_run({16: (2.0, 1.0), 1024: (2.0, 3.0), 16384: (2.0, 30.0)})) == \
        "recompute was cheaper below 1,024 tokens, swap from 1,024 up to 16,384 tokens, the longest measured"
    assert mr.crossover_sentence(made_up_run({16: (2.0, 1.0), 64: (2.0, 3.0), 256: (2.0, 1.0)})) == \
        "swap was first cheaper at 64 tokens, but not at every longer one (recompute at 256)"
    assert mr.crossover_sentence(made_up_run({16: (0.0, -1.0), 64: (0.0, -0.5), 256: (0.2, 1.4)})) == \
        "swap at 256 tokens, the longest measured; below that, neither: both hidden at 16, 64"
    assert mr.crossover_sentence(made_up_run({16: (0.0, -1.0), 64: (1.0, 0.5)})) == \
        "swap was cheaper at no length measured, up to 64 tokens (neither: both hidden at 16; recompute at 64)"
    assert mr.crossover_sentence(made_up_run({16: (1.0, 2.0), 64: (1.0, 3.0)})) == \
        "swap was cheaper at every length measured, 16 to 64 tokens"


def test_a_swap_not_clear_of_zero_is_shown_so_and_wins_nothing():
    """The H200 runs beside a decode batch of 32 recorded swaps of 0 ms (what they added to the pass, floored at 0) at
    64 and 256 tokens; their rows said "0.00" and "cheaper: swap", though moving 4 to 16 blocks is never free."""
    run = made_up_run({16: (1.7e-5, 6.9e-4), 64: (0.0, 1.5e-3), 256: (0.0, 6.8e-4), 1024: (1.1e-3, 1.8e-3)})
    rows = {r["victim tokens"]: r for r in mr.victim_rows(run)}
    assert rows[64]["swap ms"] == rows[256]["swap ms"] == "not clear of 0"
    assert rows[64]["cheaper"] == rows[256]["cheaper"] == mr.UNDECIDED
    assert [rows[n]["cheaper"] for n in (16, 1024)] == ["swap", "swap"]
    assert mr.crossover_sentence(run) == ("swap was cheaper at every decided length, 16 to 1,024 tokens; "
                                          "undecided at 64, 256 tokens, where the swap was not clear of 0")
    assert mr.decided(run.victims) == [run.victims[0], run.victims[3]]
    for committed in load_runs():
        for v, row in zip(committed.victims, mr.victim_rows(committed)):
            assert v.swap_seconds > 0 or row["cheaper"] in (mr.UNDECIDED, mr.HIDDEN), (committed.name, row)


def test_a_cost_within_the_noise_of_identical_decode_passes_is_not_clear_of_zero():
    """The H200 runs beside a decode batch of 32 counted 16-token swaps of 0.017 ms as wins with no noise figure to
    say whether they were clear of it. A run that records how far identical passes differed (``noise_seconds``)
    decides nothing with a swap inside it, and prices a recompute inside it at nothing."""
    run = made_up_run({16: (1.7e-5, 6.9e-4), 64: (4e-5, 3e-5), 1024: (1.1e-3, 1.8e-3)})
    run.victims = [replace(v, noise_seconds=5e-5) for v in run.victims]
    rows = {r["victim tokens"]: r for r in mr.victim_rows(run)}
    assert rows[16]["swap ms"] == "not clear of 0" and rows[16]["cheaper"] == mr.UNDECIDED
    assert rows[64]["recompute ms"] == "not clear of 0" and rows[64]["cheaper"] == mr.HIDDEN
    assert rows[1024]["cheaper"] == "swap" and rows[1024]["swap ms"] == pytest.approx(1.1)
    assert mr.crossover(run) == 1024 and mr.decided(run.victims) == [run.victims[2]]
    assert mr.victim_ratios(run) == [(1024, pytest.approx(1.8 / 1.1))]
    assert mr.crossover_sentence(run) == ("swap at 1,024 tokens, the longest measured; below that, neither: both "
                                          "hidden at 64; undecided at 16 tokens, where the swap was not clear of 0")
    raw = asdict(run)
    assert mr.MeasuredRun.from_dict(raw) == run
    for victim in raw["victims"]:
        del victim["noise_seconds"]  # a run recorded before the noise was: judged against 0, as it was
    assert [mr.way(v) for v in mr.MeasuredRun.from_dict(raw).victims] == ["swap", "recompute", "swap"]


def test_returning_turns_are_labelled_without_a_batch_and_shown_once():
    """Returning turns are timed alone: two runs of one shape, with and without a decode batch beside their victims,
    carry the same returning turns, which a lesson showed twice under the two batch labels."""
    turns = [(256, 1.0, 2.0), (4096, 9.0, 4.0)]
    alone, beside = made_up_run({16: (1.0, 2.0)}, batch=0, returning=turns), made_up_run({16: (0.5, 2.0)}, returning=turns)
    assert mr.returning_runs([alone, beside]) == [alone]
    label = mr.returning_label(beside)
    assert "batch" not in label and "returning turns alone" in label and beside.device in label and beside.date in label
    other = made_up_run({16: (1.0, 2.0)}, returning=[(256, 1.0, 3.0)])
    assert mr.returning_runs([alone, beside, other]) == [alone, other]
    labels = [mr.returning_label(r) for r in mr.returning_runs(load_runs())]
    assert len(labels) == len(set(labels)), labels


def test_recorded_lines_say_which_way_each_model_went_at_the_lengths_it_decided():
    swaps = made_up_run({16: (1.0, 2.0), 64: (0.0, 3.0), 4096: (1.0, 9.0)})
    mixed = mr.MeasuredRun(**{**made_up_run({16: (2.0, 1.0), 1024: (1.0, 2.0)}).__dict__, "model": "default"})
    assert mr.recorded_lines([swaps, mixed]) == [
        f"NVIDIA L4, {swaps.model} in bfloat16, blocks of 16, 2026-12-05, victims of 16 to 4,096 tokens, beside a "
        "decode batch of 32: swap was cheaper at every length decided",
        "NVIDIA L4, the built-in model in bfloat16, blocks of 16, 2026-12-05, victims of 16 to 1,024 tokens, beside a "
        "decode batch of 32: swap was cheaper at some lengths, recompute at others"]
    alone = made_up_run({16: (1.0, 2.0)}, batch=0)
    assert "tokens, alone and beside a decode batch of 32: swap" in mr.recorded_lines([alone, swaps])[0]


def test_victim_rows_carry_the_times_in_milliseconds():
    rows = mr.victim_rows(made_up_run({64: (0.002, 0.0005)}))
    assert rows == [{"victim tokens": 64, "swap ms": pytest.approx(2.0), "recompute ms": pytest.approx(0.5),
                     "cheaper": "recompute"}]


def test_returning_turns_name_where_copying_back_first_won():
    run = made_up_run({16: (1.0, 2.0)}, returning=[(1024, 3.0, 2.0), (256, 1.0, 2.0), (4096, 9.0, 4.0)])
    assert [r["cheaper"] for r in mr.returning_rows(run)] == ["copy back", "recompute", "copy back"]
    assert mr.returning_sentence(run) == "copying back was first cheaper at 1,024 tokens of context (timed up to 4,096)"
    never = made_up_run({16: (1.0, 2.0)}, returning=[(256, 1.0, 2.0)])
    assert mr.returning_sentence(never) == "recomputing was cheaper at every context timed, up to 256 tokens"


def test_a_run_label_names_device_shape_batch_block_size_and_date():
    run = made_up_run({16: (1.0, 2.0)}, batch=0)
    label = mr.run_label(run)
    for part in (run.device, run.model, run.dtype, "no decode batch", f"blocks of {run.block_size}", run.date):
        assert part in label
    assert "decode batch of 32" in mr.run_label(made_up_run({16: (1.0, 2.0)}))
    assert "the built-in model" in mr.run_label(mr.MeasuredRun(**{**run.__dict__, "model": "default"}))


def made_up_check(figures: list[dict], device: str = "NVIDIA A100-SXM4-80GB", capability: str = "8.0") -> dict:
    return {"preflight": {"kind": "preflight", "date": "2026-12-06T10:00:00+00:00", "device": device,
                          "capability": capability, "torch": "2.5", "cuda": "12.4", "triton": "3.1", "python": "3.11"},
            "parts": [], "figures": figures, "errors": [],
            "targets": [{"target": "t", "value": None, "met": None}, {"target": "u", "value": 1.5, "met": False}]}


DECODE = {"kind": "figure", "part": "decode", "figure": "decode bandwidth", "value": 61.5, "unit": "% of HBM peak",
          "dtype": "bfloat16", "shape": "8 x 2,048", "kernel": "triton paged", "splits": 1, "block_n": 64,
          "gbps": 1254.6}
SWAP = {"kind": "figure", "part": "swap", "figure": "swap", "value": 90.0, "unit": "% of a pinned contiguous copy",
        "direction": "in", "host_blocks": "scattered", "block_size": 16, "block_kib": 2048.0, "gbps": 22.5,
        "contiguous_gbps": 25.0}


def test_decode_rows_label_every_figure_and_survive_a_missing_kind():
    checks = [made_up_check([DECODE, {**DECODE, "block_size": 32, "value": 70.0}]),
              made_up_check([SWAP], "NVIDIA L4", "8.9")]
    rows = mr.gpu_decode_rows(checks)
    assert [(r["% of HBM peak"], r["block size"]) for r in rows] == [(61.5, mr.DECODE_BENCH["block_size"]), (70.0, 32)]
    assert all(r["device, date"] == "NVIDIA A100-SXM4-80GB (sm_80), 2026-12-06" and r["batch x context"] == "8 x 2,048"
               for r in rows)
    assert [r["device, date"] for r in mr.gpu_swap_rows(checks)] == ["NVIDIA L4 (sm_89), 2026-12-06"]
    assert mr.gpu_decode_rows([made_up_check([SWAP])]) == [] and mr.gpu_decode_rows([]) == []
    assert [r["met"] for r in mr.target_rows(checks[:1])] == ["not measured", "not met"]


def test_the_gpu_markdown_shows_what_the_file_holds(tmp_path):
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"about": "", "runs": []}))
    assert "No GPU run is recorded yet" in mr.gpu_markdown(path)
    run = made_up_run({16: (2.0, 1.0), 64: (2.0, 3.0)})
    path.write_text(json.dumps({"about": "", "runs": [asdict(run)], "gpu_checks": [made_up_check([DECODE])]}))
    text = mr.gpu_markdown(path)
    assert mr.run_label(run) in text and mr.crossover_sentence(run) in text
    assert "| NVIDIA A100-SXM4-80GB (sm_80), 2026-12-06 | bfloat16 | 8 x 2,048 |" in text
    assert "### Swap" not in text  # no swap figure recorded, no swap table
    assert [line for line in text.splitlines() if line.startswith("## ")] == [mr.GPU_HEADING]


def test_benchmarks_md_holds_the_gpu_section_the_committed_file_writes():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert mr.GPU_HEADING in text, "BENCHMARKS.md has no GPU section: paste kvlib.course.measured_runs.gpu_markdown()"
    start = text.index(mr.GPU_HEADING)
    end = text.find("\n## ", start + 1)
    section = text[start:] if end < 0 else text[start:end + 1]
    assert section.rstrip("\n") == mr.gpu_markdown().rstrip("\n"), \
        "BENCHMARKS.md's GPU section is out of date: replace it with kvlib.course.measured_runs.gpu_markdown()"


def test_the_committed_gpu_checks_are_labelled_with_device_and_date():
    for check in mr.load_gpu_checks():
        assert check["preflight"]["device"] and check["preflight"]["date"][:2] == "20"
        assert check["preflight"]["device"] in mr.check_label(check)


def test_two_checks_of_one_day_on_one_device_are_told_apart_by_their_commit():
    first, second = (made_up_check([DECODE]) for _ in range(2))
    first["preflight"]["commit"], second["preflight"]["commit"] = "556d11f", "f1801b8"
    assert mr.check_label(first) == "NVIDIA A100-SXM4-80GB (sm_80), 2026-12-06, at 556d11f"
    assert mr.check_label(second) != mr.check_label(first)
    labels = [mr.check_label(check) for check in mr.load_gpu_checks()]
    assert len(set(labels)) == len(labels), f"committed GPU checks share a label: {labels}"


def test_every_other_figure_of_a_committed_check_says_what_sets_it_apart():
    """Four "swap paths" rows read "-, 59.5" before: which direction, block size and path each was went unsaid."""
    rows = mr.gpu_other_rows(mr.load_gpu_checks())
    keys = [(r["device, date"], r["figure"], r["shape"]) for r in rows]
    assert len(set(keys)) == len(keys), [k for k in keys if keys.count(k) > 1]
    swap = next(r for r in rows if r["figure"] == "swap paths")
    assert swap["shape"] == "512 KiB blocks, scattered host blocks, out, 64 MiB (one direct kernel: 79.6%)"


def test_victim_ratios_leave_out_what_a_log_plot_cannot_show():
    run = made_up_run({16: (2.0, 1.0), 64: (0.0, 3.0), 256: (2.0, None), 1024: (4.0, -0.1), 4096: (1.0, 3.0)})
    assert mr.victim_ratios(run) == [(16, 0.5), (4096, 3.0)]


def test_only_a_triton_kernel_has_a_tile_length():
    checks = [made_up_check([DECODE, {**DECODE, "kernel": "torch sdpa, contiguous", "splits": None}])]
    assert [(r["BLOCK_N"], r["splits"]) for r in mr.gpu_decode_rows(checks)] == [(64, 1), ("-", "-")]


def test_a_measured_shape_on_a_gpu_replaces_its_modelled_line():
    run = made_up_run({16: (1.0, 2.0)})  # an L4, llama-3.1-8b-shaped
    assert mr.has_measurement("L4", "Llama-3-8B", [run])
    assert not mr.has_measurement("L4", "SmolLM2-135M", [run])
    assert not mr.has_measurement("T4", "Llama-3-8B", [run])
    h200 = mr.MeasuredRun(**{**run.__dict__, "device": "NVIDIA GH200 480GB"})
    assert not mr.has_measurement("H200 SXM 141GB", "Llama-3-8B", [h200])
    assert mr.has_measurement("GH200 144GB", "Llama-3-8B", [h200])
    small = mr.MeasuredRun(**{**run.__dict__, "model": "llama-3.2-1b-shaped (random bfloat16 weights)"})
    assert not mr.has_measurement("L4", "Llama-3-8B", [small]) and not mr.has_measurement("L4", "Llama-3-8B", [])


def test_a_decode_sweep_shows_its_graph_replayed_figures_beside_the_first_bench():
    sweep = {"kind": "figure", "part": "decode", "figure": "decode sweep", "value": 88.0, "shape": "32 x 4,096",
             "variant": "2 splits, BLOCK_N 32 (the rule's count)", "splits": 2, "block_n": 32, "graph GB/s": 4224.0,
             "eager GB/s": 3000.0}
    sdpa = {**sweep, "variant": "torch sdpa, contiguous", "splits": None, "block_n": None, "value": 80.0}
    failed = {"kind": "figure", "part": "decode", "figure": "decode sweep", "value": None, "shape": "1 x 32,768",
              "variant": "BLOCK_N 128", "error": "OutOfResources: shared memory"}
    rows = mr.gpu_decode_rows([made_up_check([sweep, sdpa, failed, DECODE])])
    assert [(r["kernel"], r["timed"], r["GB/s"], r["BLOCK_N"], r["dtype"]) for r in rows] == [
        ("triton paged", "eager", 1254.6, 64, "bfloat16"),
        (sweep["variant"], "graph-replayed", 4224.0, 32, mr.DECODE_BENCH["dtype"]),
        ("torch sdpa, contiguous", "graph-replayed", 4224.0, "-", mr.DECODE_BENCH["dtype"])]
