"""``kvlib bench scheduler`` drives the real scheduler: its rows count what really happened (no timing is checked)."""
from kvlib.cli.bench.scheduler import main, time_scheduler


def test_a_roomy_pool_never_preempts_and_a_tight_one_does():
    roomy = time_scheduler(8, prompt_len=16, steps=8, block_size=4, repeats=2)
    tight = time_scheduler(8, prompt_len=16, steps=8, block_size=4, pressure=True, repeats=2)
    assert roomy["preemptions"] == 0 and tight["preemptions"] > 0
    for row in (roomy, tight):
        assert row["running seqs"] == 8 and row["ms/step"] > 0 and row["ms/step p99"] > 0


def test_prefix_caching_row_serves_the_same_steps():
    row = time_scheduler(4, prompt_len=8, steps=4, block_size=4, enable_prefix_caching=True, repeats=1)
    assert row["prefix caching"] is True and row["preemptions"] == 0


def test_the_command_prints_one_row_per_setting(capsys):
    assert main(["--steps", "2", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "scheduler time per decode step (no model)"
    assert [line.split()[:3] for line in lines[3:]] == [["32", "False", "False"], ["256", "False", "False"],
                                                         ["256", "True", "False"], ["256", "False", "True"]]
