"""``kvlib bench serve`` reports every figure it promises and saves the timeline (its timings are never judged)."""
from __future__ import annotations

import json
import math

from kvlib.cli.bench import serve

FIELDS = ["requests", "completed", "failed", "seconds", "requests/s", "output tokens", "output tokens/s",
          *(f"{m} p{q} ms" for m in ("TTFT", "TPOT", "E2E") for q in (50, 90, 99)), "preemptions", "peak KV usage",
          "/health p50 ms", "/health p99 ms", "/health max ms", "hostile requests", "errors", "timeline"]


def test_arrivals_are_seeded_poisson_gaps_or_all_at_once():
    times = serve.poisson_arrivals(2000, rate=50.0, seed=3)
    assert times == serve.poisson_arrivals(2000, rate=50.0, seed=3) != serve.poisson_arrivals(2000, 50.0, seed=4)
    assert times[0] == 0.0 and times == sorted(times)
    assert math.isclose(times[-1] / 1999, 1 / 50.0, rel_tol=0.1)  # the mean gap of 2,000 exponential draws
    assert serve.poisson_arrivals(5, rate=math.inf) == [0.0] * 5


def test_a_tiny_run_reports_every_field_and_saves_the_timeline(tmp_path):
    path = tmp_path / "timeline.json"
    report = serve.run_serve_bench(num_requests=6, rate=math.inf, scale=16, num_gpu_blocks=12, num_cpu_blocks=24,
                                   sample_interval=0.02, timeline_path=str(path))
    assert list(report) == FIELDS
    assert (report["requests"], report["completed"], report["failed"], report["errors"]) == (6, 6, 0, [])
    lengths = [m for _, m in serve.workload(6, scale=16, seed=0)]
    assert report["output tokens"] == sum(lengths)
    assert all(report[f] is not None for f in FIELDS if f.endswith(" ms") and not f.startswith("TPOT"))
    assert report["hostile requests"] is None
    timeline = json.loads(path.read_text())
    assert len(timeline) >= 2 and set(timeline[0]) == {"seconds", "gpu_cache_usage", "cpu_cache_usage", "running",
                                                        "waiting", "swapped", "preemptions"}
    # the peak is the samples' own: a run this short may end between two samples, so it may be 0 here
    assert report["preemptions"] >= 0 and report["peak KV usage"] == max(s["gpu_cache_usage"] for s in timeline)
    assert 0.0 <= report["peak KV usage"] <= 1.0
    assert timeline[-1]["running"] == timeline[-1]["waiting"] == 0 and timeline[-1]["gpu_cache_usage"] == 0.0


def test_the_command_prints_the_report_and_draws_a_png(tmp_path, capsys):
    path = tmp_path / "timeline.png"
    assert serve.main(["--num-requests", "3", "--rate", "inf", "--scale", "16", "--num-gpu-blocks", "12",
                       "--timeline", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Serving: 3 requests" in out and all(f in out for f in ("TTFT p99 ms", "TPOT p50 ms", "preemptions"))
    assert path.read_bytes().startswith(b"\x89PNG")


def test_a_hostile_client_is_refused_and_reported_beside_the_requests():
    report = serve.run_serve_bench(num_requests=4, rate=math.inf, scale=16, num_gpu_blocks=12, num_cpu_blocks=24,
                                   sample_interval=0.02, hostile=True)
    assert (report["completed"], report["failed"]) == (4, 0)
    kinds = {kind: int(count) for count, kind in (part.split(" x ") for part in report["hostile requests"].split(", "))}
    assert set(kinds) <= {"413 request_too_large", "closed", "400 too_many_prompts", "400 too_many_prompt_tokens"}
    assert {"400 too_many_prompts", "400 too_many_prompt_tokens"} <= set(kinds)
    assert report["/health p50 ms"] <= report["/health p99 ms"] <= report["/health max ms"]
