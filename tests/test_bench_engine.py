"""The engine benchmark serves the same requests with every engine at the same KV slots, counts only the tokens
asked for, and reports medians of paired rounds against the strongest baseline."""
import pytest

import kvlib.cli.bench.engine as bench
import kvlib.cli.bench.engine_baselines as baselines
from kvlib.cli.bench.engine import (KvlibServer, compare, headline, make_workload, row_caps, run_kvlib,
                                    run_transformers, summary_rows)
from kvlib.cli.bench.engine_baselines import (PagedBatches, StaticBatches, has_paged_batching, load_transformers,
                                              static_batch)
from kvlib.cli.bench.engine_workload import Placement, Request, served_row


def test_workload_is_seeded_and_arrives_in_order():
    a, b = make_workload(6, 0.1, 50.0, vocab_size=100), make_workload(6, 0.1, 50.0, vocab_size=100)
    assert [(r.arrival, r.prompt, r.max_tokens) for r in a] == [(r.arrival, r.prompt, r.max_tokens) for r in b]
    assert all(x.arrival < y.arrival for x, y in zip(a, a[1:]))
    assert all(3 <= t < 100 for r in a for t in r.prompt)


def test_both_engines_serve_every_request(checkpoint):
    folder = checkpoint("llama-gqa")
    requests = make_workload(4, 0.05, 1000.0, vocab_size=96)
    budget = 4 * max(len(r.prompt) + r.max_tokens for r in requests)
    for row in (run_kvlib(folder, requests, budget, block_size=4), run_transformers(folder, requests, budget)):
        assert row["output tokens/s"] * row["wall s"] == pytest.approx(sum(r.max_tokens for r in requests))
        assert 0 <= row["TTFT p50 s"] <= row["E2E p99 s"]
        assert [len(t) for t in row["tokens"]] == [r.max_tokens for r in requests]  # end of sequence ignored


def test_the_step_profile_accounts_for_the_steps(checkpoint):
    folder = checkpoint("llama-gqa")
    requests = make_workload(4, 0.05, 1000.0, vocab_size=96)
    profile = run_kvlib(folder, requests, 4 * max(len(r.prompt) + r.max_tokens for r in requests), block_size=4)["profile"]
    parts = ("scheduling %", "block moves %", "forward %", "sampling %", "other %")
    assert sum(profile[p] for p in parts) == pytest.approx(100)
    assert 0 < profile["attention %"] < profile["forward %"] and profile["other %"] >= 0


def _requests(*shapes):
    return [Request(arrival, [5] * prompt, new) for arrival, prompt, new in shapes]


def test_a_static_batch_never_holds_more_than_the_slots():
    queue = _requests((0.0, 10, 6), (0.0, 3, 2), (0.0, 20, 4), (0.0, 2, 2), (5.0, 1, 1))
    assert static_batch(queue, now=1.0, slots=64, max_rows=8) == queue[:2]  # a third row at width 20: 3 * 26 > 64
    assert static_batch(queue, now=1.0, slots=200, max_rows=8) == queue[:4]  # the fifth has not arrived
    assert static_batch(queue, now=9.0, slots=200, max_rows=3) == queue[:3]
    assert static_batch(queue[1:], now=1.0, slots=5, max_rows=8) == queue[1:2]


def test_transformers_static_batches_fit_the_budget(checkpoint, monkeypatch):
    """The longest prompt and the longest output belong to different requests: rows times (longest prompt plus
    longest output) was up to 1.45x kvlib's pool when the batch size came from the longest request alone."""
    import transformers
    padded = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def from_pretrained(*args, **kwargs):
        model = real(*args, **kwargs)
        generate = model.generate

        def recorded(input_ids, **options):
            padded.append(input_ids.shape[0] * (input_ids.shape[1] + options["max_new_tokens"]))
            return generate(input_ids, **options)
        model.generate = recorded
        return model
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    requests = _requests((0.0, 10, 2), (0.0, 2, 10), (0.0, 10, 2), (0.0, 2, 10))
    row = run_transformers(checkpoint("llama-gqa"), requests, 24)
    assert padded and max(padded[1:]) <= 24  # the first call is the warm-up
    assert row["KV slots"] == max(padded[1:])


def test_row_caps_run_from_the_longest_request_to_the_shortest():
    requests = _requests((0.0, 10, 6), (0.0, 3, 1)) * 20
    assert row_caps(requests, 64) == [4, 8, 16]  # 64 // 16 = 4 rows at the longest, 64 // 4 = 16 at the shortest
    assert row_caps(requests[:6], 64) == [4, 6]  # never more rows than requests


def test_a_request_longer_than_the_slots_is_refused_with_the_fix(checkpoint):
    folder, placement = checkpoint("llama-gqa"), Placement.auto()
    batches = StaticBatches(load_transformers(folder, placement), 8, 1, "dynamic", placement)
    with pytest.raises(ValueError, match="needs 12 KV slots.*holds 8.*--budget"):
        batches.serve(_requests((0.0, 10, 2)))


def test_inter_token_latency_is_the_gaps_between_a_requests_tokens():
    """Not decode time per output token: request 0's tokens came 0.1 s then 0.4 s apart, which (E2E - TTFT) / 2
    would average to 0.25 s."""
    requests = _requests((0.0, 3, 3), (0.2, 3, 2))
    arrivals, done, tokens = {0: [0.1, 0.2, 0.6], 1: [0.3, 0.35]}, {0: 0.6, 1: 0.35}, {0: [7, 8, 9], 1: [7, 8]}
    row = served_row("engine", requests, (1.0, arrivals, done, tokens), 64)
    assert (row["ITL p50 s"], row["ITL p99 s"]) == (pytest.approx(0.1), pytest.approx(0.4))  # of 0.05, 0.1, 0.4
    assert (row["TTFT p50 s"], row["TTFT p99 s"]) == (pytest.approx(0.1), pytest.approx(0.1))
    assert "ITL note" not in row


def test_inter_token_latency_unmeasured_is_none_with_the_reason():
    requests = _requests((0.0, 3, 3), (0.0, 3, 1))
    first_only = served_row("engine x", requests, (1.0, {0: [0.1], 1: [0.2]}, {0: 0.5, 1: 0.2},
                                                   {0: [7, 8, 9], 1: [7]}), 64)
    assert first_only["ITL p50 s"] is None and first_only["ITL p99 s"] is None
    assert first_only["ITL note"] == "not measured: engine x did not report when each token arrived"
    one_token = served_row("engine", requests[1:], (1.0, {0: [0.2]}, {0: 0.2}, {0: [7]}), 64)
    assert one_token["ITL p50 s"] is None
    assert one_token["ITL note"] == "not measured: no request asked for a second token"


def test_every_engine_times_each_token_as_it_arrives(checkpoint, monkeypatch):
    """kvlib from its steps' outputs, transformers' static batches from the streamer's steps, its paged batching
    from the timestamps it records: one time per token, later than the one before."""
    served = {}

    def recorded(name, requests, times, slots):
        served[name] = times
        return served_row(name, requests, times, slots)
    monkeypatch.setattr(bench, "served_row", recorded)
    monkeypatch.setattr(baselines, "served_row", recorded)
    folder, placement = checkpoint("llama-gqa"), Placement.auto()
    requests = make_workload(4, 0.05, 1000.0, vocab_size=96)
    slots = 4 * max(len(r.prompt) + r.max_tokens for r in requests)
    model = load_transformers(folder, placement)
    engines = [KvlibServer(folder, slots, 4, placement=placement), StaticBatches(model, slots, 2, "dynamic", placement)]
    engines += [PagedBatches(model, slots, 4, 64, placement)] if has_paged_batching(model) else []
    for engine in engines:
        row = engine.serve(requests)
        elapsed, arrivals, done, tokens = served[engine.name]
        for i, r in enumerate(requests):
            assert len(arrivals[i]) == len(tokens[i]) == r.max_tokens, engine.name
            assert r.arrival <= arrivals[i][0] and all(a < b for a, b in zip(arrivals[i], arrivals[i][1:])), engine.name
            assert arrivals[i][-1] <= done[i] + 1e-9, engine.name
        assert 0 < row["ITL p50 s"] <= row["ITL p99 s"], engine.name
    assert len(served) == len(engines)


@pytest.fixture(scope="module")
def report(checkpoint):
    requests = make_workload(4, 0.05, 1000.0, vocab_size=96)
    budget = 3 * max(len(r.prompt) + r.max_tokens for r in requests) + 3  # not whole blocks of 4
    return requests, compare(checkpoint("llama-gqa"), requests, budget, block_size=4, rounds=2, caches=("dynamic",))


def test_every_engine_gets_the_same_kv_slots(report):
    requests, report = report
    budget = 3 * max(len(r.prompt) + r.max_tokens for r in requests) + 3
    assert report["slots"] == budget // 4 * 4
    kvlib, *baselines = report["runs"]
    assert all(run["KV slots"] == report["slots"] for run in report["runs"][kvlib])
    for name in baselines:
        for run in report["runs"][name]:
            if name.startswith("transformers paged"):
                assert run["KV slots"] == report["slots"]  # read from the paged cache transformers built
                assert "KV slots note" not in run  # read, not the slots asked for
            else:
                assert 0 < run["KV slots"] <= report["slots"]  # the largest padded batch it ran
    assert all(0 < row["KV slots"] <= report["slots"] for row in report["tuning"])


def test_the_report_pairs_rounds_and_quotes_the_strongest_baseline(report, checkpoint):
    requests, report = report
    kvlib, *baselines = report["runs"]
    paged = has_paged_batching(load_transformers(checkpoint("llama-gqa"), Placement.auto()))
    assert kvlib == report["kvlib"] and len(baselines) == 1 + paged
    assert all(len(runs) == report["rounds"] == 2 for runs in report["runs"].values())
    speeds = {name: [r["output tokens/s"] for r in report["runs"][name]] for name in baselines}
    assert report["strongest"] == max(baselines, key=lambda name: sum(speeds[name]))  # two rounds: median = mean
    for name in baselines:
        ratios = [a["output tokens/s"] / b["output tokens/s"]
                  for a, b in zip(report["runs"][kvlib], report["runs"][name])]
        assert report["paired"][name] == {"median": pytest.approx(sum(ratios) / 2), "min": min(ratios),
                                          "max": max(ratios)}
    assert report["tuning"][0]["engine"].startswith("transformers generate (static batches of <=")
    assert f"{report['paired'][report['strongest']]['median']:.2f}x" in headline(report)
    assert report["strongest"] in headline(report)


def test_every_baseline_writes_kvlibs_greedy_tokens(report):
    requests, report = report
    kvlib, *baselines = report["runs"]
    assert [len(t) for t in report["runs"][kvlib][0]["tokens"]] == [r.max_tokens for r in requests]
    assert report["agree"] == {name: len(requests) for name in baselines}  # float32, the same weights
    rows = {row["engine"]: row for row in summary_rows(report)}
    assert all(rows[name]["greedy = kvlib"] == f"{len(requests)}/{len(requests)}" for name in baselines)


def test_the_summary_gives_every_engines_inter_token_latency(report):
    requests, report = report
    for row in summary_rows(report):
        assert 0 < row["ITL p50 s"] <= row["ITL p99 s"] <= row["E2E p99 s"]
        assert "notes" not in row  # every engine timed its tokens and the paged cache's slots were read


def test_the_command_prints_the_headline(checkpoint, capsys):
    assert bench.main(["--model", str(checkpoint("llama-gqa")), "--requests", "2", "--scale", "0.02",
                       "--budget", "256", "--block-size", "4", "--rounds", "1", "--static-caches", "dynamic",
                       "--static-rows", "1"]) == 0
    out = capsys.readouterr().out
    assert "the strongest baseline" in out and "medians of 1 interleaved rounds" in out and "256 KV token slots" in out
    assert "ITL p50 s" in out and "ITL p99 s" in out
    assert "static batches of <= 1," in out and "static batches of <= 2," not in out  # only the row caps asked for
    assert "one row cap and one cache asked for, so nothing to tune" in out  # no tuning pass for a single candidate


def test_every_engine_is_warmed_up_untimed_before_any_pass_that_counts(checkpoint):
    """A first pass pays for kernel compiles and a first batch's allocations: every engine, each static candidate
    included, serves a short warm-up before the tuning and the rounds, so none of them pays it in a timed pass."""
    requests = make_workload(6, 0.05, 1000.0, vocab_size=96)
    budget = 3 * max(len(r.prompt) + r.max_tokens for r in requests)
    stages = []
    report = compare(checkpoint("llama-gqa"), requests, budget, block_size=4, rounds=1, caches=("dynamic",),
                     static_rows=[1, 2], served=lambda stage, name, row: stages.append((stage, name, row)))
    warm = [(name, row) for stage, name, row in stages if stage == "warm-up"]
    timed = [name for stage, name, _ in stages if stage != "warm-up"]
    assert [stage for stage, _, _ in stages[:len(warm)]] == ["warm-up"] * len(warm)  # all before the first timed
    assert {name for name, _ in warm} == set(timed) | {row["engine"] for row in report["tuning"]}
    for _, row in warm:
        assert [len(t) for t in row["tokens"]] == [min(r.max_tokens, 4) for r in requests[:4]]


def test_a_tuning_with_nothing_to_try_is_refused(checkpoint):
    requests = _requests((0.0, 4, 2))
    with pytest.raises(ValueError, match=r"at least one cache and row caps of at least 1.*row caps \[0\]"):
        compare(checkpoint("llama-gqa"), requests, 64, block_size=4, rounds=1, static_rows=[0])


def test_rounds_below_one_are_refused():
    with pytest.raises(SystemExit, match="--rounds must be at least 1, got 0"):
        bench.main(["--rounds", "0"])
