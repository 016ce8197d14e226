"""The GPU check on a CPU: the preflight's refusals, the parts' timeouts, the results file and its import.

Nothing here needs a GPU: the parts are replaced by small commands, the preflight by fakes of what
it probes, and the results file is written by the parts' own ``Results`` writer.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvlib.cli import gpu_parts
from kvlib.cli.gpu_parts import Results, targets
from kvlib.course.measured_runs import RUNS_PATH, import_gpu_check, load_runs, measure_run

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
spec.loader.exec_module(gpu_check)


def test_the_parts_fit_in_nine_minutes_with_their_kill_grace():
    assert sum(p.limit for p in gpu_check.PARTS) + len(gpu_check.PARTS) * gpu_check.KILL_GRACE <= gpu_check.TOTAL_SECONDS
    assert gpu_check.TOTAL_SECONDS + 10 <= 9 * 60  # and the preflight's seconds
    assert [p.name for p in gpu_check.PARTS] == list(gpu_parts.PARTS)  # every part has its code, in that order


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script would run the whole check")
def test_a_cpu_machine_is_refused_in_one_line_and_nothing_runs(tmp_path):
    start = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}, timeout=120)
    assert done.returncode == 2
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "missing a CUDA build of torch" in lines[0] and "Nothing was run" in lines[0]
    records = gpu_check.read_records(tmp_path / gpu_check.RESULTS_NAME)
    assert [r["kind"] for r in records] == ["preflight"] and records[0]["missing"]
    print(f"refused in {time.monotonic() - start:.1f} s")


def test_a_missing_python_is_named(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path), "PYTHON": "no-such-python3"}, timeout=30)
    assert done.returncode == 2 and "missing no-such-python3" in done.stdout


def test_the_preflight_names_everything_missing_at_once(monkeypatch, tmp_path):
    class FakeCuda:
        is_available = staticmethod(lambda: True)
        mem_get_info = staticmethod(lambda: (2 * 2**30, 80 * 2**30))
        get_device_name = staticmethod(lambda: "NVIDIA H200")
        get_device_capability = staticmethod(lambda: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch, "cuda", FakeCuda)
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    monkeypatch.setattr(gpu_check.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    real_find = importlib.util.find_spec
    absent = ("numpy", "triton")
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec",
                        lambda name: None if name.split(".")[0] in absent else real_find(name))
    missing, found = gpu_check.missing_essentials(env={})
    assert missing == ["NumPy (kvlib's KV pools and kernels import it)", "Triton",
                       "a C compiler (cc, gcc or clang; Triton builds its launcher with it)",
                       f"Python.h ({tmp_path / 'Python.h'}; the python3-dev package)",
                       "8 GiB of free device memory (2.0 GiB free)"]
    assert found["device"] == "NVIDIA H200" and found["capability"] == "9.0"
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None if name == "torch" else real_find(name))
    assert gpu_check.missing_essentials(env={})[0] == ["torch (a CUDA build)"]


def test_cpu_torch_is_refused_by_name():
    missing, found = gpu_check.missing_essentials()
    if torch.version.cuda is None:
        assert missing[0].startswith("a CUDA build of torch") and found["torch"] == torch.__version__
        assert found["numpy"] == np.__version__


SLEEPER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
          "print('started', flush=True); time.sleep(60)"


def test_a_part_past_its_limit_is_killed_with_its_children(tmp_path):
    results, log = tmp_path / "r.jsonl", tmp_path / "log"
    part = gpu_check.Part("sleepy", 30, "sleeps")
    start = time.monotonic()
    record = gpu_check.run_part(part, [sys.executable, "-c", SLEEPER], results, log, seconds=2, env=os.environ)
    assert record["status"] == "timed out" and record["limit"] == 2  # the time left, not the part's own limit
    assert time.monotonic() - start < 2 + gpu_check.KILL_GRACE + 5
    assert "started" in log.read_text() and gpu_check.read_records(results) == [record]
    leftover = subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True).stdout.split()
    assert leftover == []  # the part's own child went with it


def fake_run(monkeypatch, tmp_path, commands: dict, limit: int = 5) -> tuple[int, list[dict]]:
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(gpu_check, "missing_essentials",
                        lambda: ([], {"device": "Fake GPU", "free_gib": 100.0, "torch": "x", "triton": "y"}))
    monkeypatch.setattr(gpu_check, "PARTS", [gpu_check.Part(name, limit, name) for name in commands])
    monkeypatch.setattr(gpu_check, "part_command", lambda part, results: [sys.executable, "-c",
                                                                          commands[part.name].format(results=str(results))])
    runs = tmp_path / "runs.json"
    shutil.copy(RUNS_PATH, runs)
    import kvlib.course.measured_runs as measured_runs
    monkeypatch.setattr(measured_runs, "RUNS_PATH", runs)
    failed = gpu_check.main([])
    return failed, gpu_check.read_records(tmp_path / gpu_check.RESULTS_NAME)


WRITE = ("from kvlib.cli.gpu_parts import Results; r = Results({results!r}, '{part}'); "
         "r.add('swap', {value}, '% of a pinned contiguous copy', direction='out', host_blocks='scattered', "
         "block_size=16, block_kib=128.0)")


def test_a_failed_or_cut_part_keeps_its_figures_and_the_next_one_runs(monkeypatch, tmp_path):
    commands = {"first": WRITE.replace("{part}", "first").replace("{value}", "91.0") + "; import time; time.sleep(60)",
                "second": "raise SystemExit(1)",
                "third": WRITE.replace("{part}", "third").replace("{value}", "42.0")}
    failed, records = fake_run(monkeypatch, tmp_path, commands)
    assert failed == 2
    parts = [(r["part"], r["status"]) for r in records if r["kind"] == "part"]
    assert parts == [("first", "timed out"), ("second", "failed"), ("third", "passed")]
    assert [r["value"] for r in records if r["kind"] == "figure"] == [91.0, 42.0]  # the cut part's figure stayed
    summary = records[-1]
    assert summary["kind"] == "summary"
    assert [(t["value"], t["met"]) for t in summary["targets"] if t["target"].startswith("swap")] == [(91.0, True),
                                                                                                     (42.0, False)]
    assert json.loads((tmp_path / "measured_costs.json").read_text())["gpu_checks"][-1]["figures"][0]["value"] == 91.0


def test_a_part_may_use_the_time_the_parts_before_it_left():
    first, second = gpu_check.Part("first", 20, "a"), gpu_check.Part("second", 10, "b")
    grace = gpu_check.KILL_GRACE
    assert gpu_check.allowance(first, [], 0.0, 500) == 20
    assert gpu_check.allowance(second, [first], 5.0, 500) == 10 + (20 + grace - 5)  # the first left 18 s of its 23
    assert gpu_check.allowance(second, [first], 20.0 + grace + 1, 500) == 10  # one that overran takes nothing away
    assert gpu_check.allowance(second, [first], 5.0, 12) == 12  # never past the time left


def test_a_part_past_its_own_limit_runs_on_in_the_time_an_earlier_part_left(monkeypatch, tmp_path):
    commands = {"quick": "pass", "slow": "import time; time.sleep(2.5)"}
    failed, records = fake_run(monkeypatch, tmp_path, commands, limit=1)
    assert failed == 0  # with its own 1 s only, the slow part would have been killed
    assert [(r["part"], r["status"]) for r in records if r["kind"] == "part"] == [("quick", "passed"),
                                                                                 ("slow", "passed")]


TESTS = """
import time
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("no device")

def test_passes():
    pass

def test_fails():
    assert 1 == 2

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

def test_setup_fails(broken):
    pass

def test_sleeps():
    time.sleep({sleep})
"""


def test_kernel_test_outcomes_are_written_as_pytest_reports_them(tmp_path):
    (tmp_path / "test_fake.py").write_text(TESTS.replace("{sleep}", "0"))
    outcomes = gpu_parts.TestOutcomes(Results(tmp_path / "r.jsonl", "kernel-tests"))
    pytest.main([str(tmp_path / "test_fake.py"), "-q", "-p", "no:cacheprovider", "-o", "addopts="],
                plugins=[outcomes])
    records = gpu_check.read_records(tmp_path / "r.jsonl")
    assert [(r["test"].split("::")[1], r["outcome"]) for r in records if r["kind"] == "test"] == [
        ("test_passes", "passed"), ("test_fails", "failed"), ("test_skipped", "skipped"),
        ("test_setup_fails", "error"), ("test_sleeps", "passed")]
    assert outcomes.counts == {"passed": 2, "failed": 1, "skipped": 1, "error": 1}
    found = {t["target"].split("::")[-1]: t["met"] for t in targets(records)}
    assert found["test_fails"] is False and found["test_setup_fails"] is False  # a failure is a target not met
    assert "no device" in next(r["error"] for r in records if r.get("figure", "").endswith("test_setup_fails"))


def test_kernel_tests_killed_midway_keep_the_outcomes_so_far(tmp_path):
    started = tmp_path / "sleeping"
    (tmp_path / "test_fake.py").write_text(TESTS.replace("time.sleep({sleep})", f"open({str(started)!r}, 'w'); "
                                                                                "time.sleep(60)"))
    results = tmp_path / "r.jsonl"
    run_tests = ("import pytest; from kvlib.cli.gpu_parts import Results, TestOutcomes; "
                 f"pytest.main([{str(tmp_path / 'test_fake.py')!r}, '-q', '-p', 'no:cacheprovider', '-o', 'addopts='], "
                 f"plugins=[TestOutcomes(Results({str(results)!r}, 'kernel-tests'))])")
    part = subprocess.Popen([sys.executable, "-c", run_tests], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not started.exists() and part.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    part.kill()  # as a part's limit would, while the last test runs
    part.wait()
    outcomes = [r["outcome"] for r in gpu_check.read_records(results) if r["kind"] == "test"]
    assert outcomes == ["passed", "failed", "skipped", "error"]  # all but the test the kill cut


def test_targets_say_met_not_met_or_not_measured(tmp_path):
    out = Results(tmp_path / "r.jsonl", "decode")
    out.add("decode sweep", 88.0, "% of HBM peak, graph-replayed", shape="32 x 4,096", engine_default=True,
            **{"graph x sdpa": 1.02})
    out.add("decode sweep", 95.0, "% of HBM peak, graph-replayed", shape="32 x 4,096", engine_default=False,
            **{"graph x sdpa": 1.2})  # a variant the engine does not run is reported, not targeted
    out.add("decode sweep", 65.0, "% of HBM peak, graph-replayed", shape="1 x 32,768", engine_default=True,
            **{"graph x sdpa": 0.9})
    out.add("engine", 1.2, "x transformers' strongest", shape="llama-3.2-1b")
    out.add("engine", 1.7, "x transformers' strongest", shape="llama-3.1-8b")
    out.add("float32 triton greedy tokens equal transformers", True, "bool")
    out.add("float32 torch: decode graphs", "not captured: the backend declares itself not graph-safe", "fact")
    found = {t["target"]: t["met"] for t in targets(gpu_check.read_records(tmp_path / "r.jsonl"))}
    assert found == {"decode 32 x 4,096 >= 85% of HBM peak (graph-replayed)": True,
                     "decode 1 x 32,768 >= 85% of HBM peak (graph-replayed)": False,
                     "decode 32 x 4,096 at least as fast as torch SDPA over a contiguous cache (graph-replayed)": True,
                     "decode 1 x 32,768 at least as fast as torch SDPA over a contiguous cache (graph-replayed)": False,
                     "graph decode under a long bound as fast as under its own": None,
                     "swap >= 85% of a pinned contiguous copy": None,
                     "engine llama-3.2-1b-shaped >= 1.5x transformers' strongest": False,
                     "engine llama-3.1-8b-shaped >= 1.5x transformers' strongest": True,
                     "float32 triton greedy tokens equal transformers": True}


def test_the_results_import_as_the_first_gpu_rows(tmp_path):
    torch.set_num_threads(1)
    results, runs = tmp_path / "gpu_check.jsonl", tmp_path / "runs.json"
    shutil.copy(RUNS_PATH, runs)
    before = len(load_runs(runs))
    gpu_check.append(results, {"kind": "preflight", "device": "NVIDIA H200", "missing": []})
    out = Results(results, "costs")
    run = measure_run("first GPU check, test", "default", victim_lengths=[16], contexts=[16])
    out.write({"kind": "measured_run", "part": "costs", "run": json.loads(json.dumps(run, default=vars))})
    out.add("engine", 2.0, "x transformers' strongest", shape="llama-3.2-1b")
    out.error("transformers", ImportError("no transformers"))
    assert import_gpu_check(results, runs) == 1
    loaded = load_runs(runs)
    assert len(loaded) == before + 1 and loaded[-1] == run
    check = json.loads(runs.read_text())["gpu_checks"][-1]
    assert check["preflight"]["device"] == "NVIDIA H200" and check["errors"][0]["check"] == "transformers"
    assert {"target": "engine llama-3.2-1b-shaped >= 1.5x transformers' strongest", "value": 2.0,
            "met": True} in check["targets"]


def test_a_file_that_is_not_a_gpu_checks_results_is_refused(tmp_path):
    bad = tmp_path / "other.jsonl"
    bad.write_text('{"kind": "figure"}\n')
    with pytest.raises(ValueError, match="no preflight record"):
        import_gpu_check(bad, tmp_path / "unused.json")


def test_an_unknown_part_gets_its_usage(capsys):
    assert gpu_parts.main(["nope", "file"]) == 2
    assert "usage: python -m kvlib.cli.gpu_parts {shapes,real-tokens," in capsys.readouterr().err


def test_parts_can_be_chosen_by_name_in_the_order_given(capsys):
    assert [p.name for p in gpu_check.chosen_parts(["--parts", "swap,shapes"])] == ["swap", "shapes"]
    assert gpu_check.chosen_parts([]) == gpu_check.PARTS
    with pytest.raises(SystemExit):
        gpu_check.chosen_parts(["--parts", "swap,nope"])
    assert "unknown part(s) nope; the parts are shapes," in capsys.readouterr().err


def test_a_chosen_part_runs_alone_and_its_results_are_appended(monkeypatch, tmp_path):
    (tmp_path / gpu_check.RESULTS_NAME).write_text('{"kind": "preflight", "commit": "earlier"}\n')
    monkeypatch.setattr(gpu_check, "chosen_parts", lambda argv: [gpu_check.Part("third", 5, "third")])
    commands = {"third": WRITE.replace("{part}", "third").replace("{value}", "90.0"), "first": "raise SystemExit(1)"}
    failed, records = fake_run(monkeypatch, tmp_path, commands)
    assert failed == 0 and records[0]["commit"] == "earlier"  # the earlier records stay
    assert [(r["part"], r["status"]) for r in records if r["kind"] == "part"] == [("third", "passed")]


def test_the_commit_is_the_checkouts_own_never_an_enclosing_repositorys(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    inner = tmp_path / "copy"
    inner.mkdir()  # a copy of the tree without its own history, inside another repository
    assert gpu_check.commit(inner, env={}).startswith("unknown (no git history of its own")
    assert gpu_check.commit(inner, env={"KVLIB_COMMIT": "abc1234"}) == "abc1234"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert gpu_check.commit(ROOT, env={}) == head
