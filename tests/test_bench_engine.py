"""The engine benchmark serves the same requests both ways and counts only the tokens asked for."""
import pytest

from kvlib.cli.bench.engine import make_workload, run_kvlib, run_transformers


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


def test_the_step_profile_accounts_for_the_steps(checkpoint):
    folder = checkpoint("llama-gqa")
    requests = make_workload(4, 0.05, 1000.0, vocab_size=96)
    profile = run_kvlib(folder, requests, 4 * max(len(r.prompt) + r.max_tokens for r in requests), block_size=4)["profile"]
    parts = ("scheduling %", "block moves %", "forward %", "sampling %", "other %")
    assert sum(profile[p] for p in parts) == pytest.approx(100)
    assert 0 < profile["attention %"] < profile["forward %"] and profile["other %"] >= 0
