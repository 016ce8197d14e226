"""Recorded runs: the committed file loads, a run survives saving, and recording one works on this machine."""
import json
import shutil

import torch

from kvlib.cli.commands import main
from kvlib.course.measured_runs import RUNS_PATH, load_runs, measure_run, save_run


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
