"""Lab 09 checks: the learner's preemption report and oversubscription detector, by hand and in the engine.

kvlib has no report, and its OversubscriptionDetector judges the whole run: both references are written here and
hidden while grading (with EngineMetrics.summary and kvlib's detector). Metrics are drawn from the seed; detector
checks observe what any correct design answers (whether and when it warned, how often, what it names), measured
by the grader from the answers each observe call gave in the sandbox (``decisions.answer_of``).
"""
from __future__ import annotations

import collections
import copy
import random
from functools import cache

from kvlib.config import SamplingParams
from kvlib.course.grading.checks import Task, close, expect
from kvlib.course.grading.decisions import answer_of
from kvlib.course.grading.serving import random_tokens
from kvlib.course.grading.workloads import Arrival, Watched, replay_run, replay_watched, serve_watched, step_record
from kvlib.metrics import EngineMetrics, RequestMetrics


def _reference_report():
    import statistics
    def preemption_report(metrics: EngineMetrics, window: int = 16) -> dict:
        records = list(metrics.requests.values())
        groups = {"preempted": [r for r in records if r.num_preemptions],
                  "not_preempted": [r for r in records if not r.num_preemptions]}
        steps = [s.num_preemptions for s in metrics.timeline]
        work = metrics.num_prompt_tokens + metrics.num_generated_tokens + metrics.num_recomputed_tokens
        return {"preemptions_per_finished_request": metrics.num_preemptions / max(1, metrics.num_finished),
                "preempted_share": len(groups["preempted"]) / len(records) if records else None,
                "worst_stutter": {k: max((r.max_inter_token_latency for r in g), default=None) for k, g in groups.items()},
                "median_ttft": {k: statistics.median(t) if (t := [r.ttft for r in g if r.ttft is not None]) else None
                                for k, g in groups.items()},
                "busiest_window": max(sum(steps[i:i + window]) for i in range(max(1, len(steps) - window + 1))),
                "recomputed_share": metrics.num_recomputed_tokens / work if work else 0.0}
    return preemption_report


def _reference_detector():
    class RecentRequests:
        def __init__(self, threshold: float = 1.0):
            self.threshold, self.recent, self.seen, self.warned = threshold, collections.deque(maxlen=16), 0, False

        def observe(self, metrics: EngineMetrics) -> str | None:
            new, self.seen = metrics.num_finished - self.seen, metrics.num_finished
            self.recent.extend(r.num_preemptions for r in list(metrics.requests.values())[-new:] if new > 0)
            if self.warned or len(self.recent) < 8 or (rate := sum(self.recent) / len(self.recent)) <= self.threshold:
                return None
            self.warned = True
            return f"oversubscribed: {rate:.1f} preemptions per request; raise num_gpu_blocks or lower max_num_seqs"
    return RecentRequests


DETECTOR = ("kvlib.core.oversubscription:OversubscriptionDetector", "kvlib.course.grading.lab09:_reference_detector")
report = Task("report", ("preemption_report",), ("kvlib.course.grading.lab09:_reference_report",
                                                 "kvlib.metrics:EngineMetrics.summary"), _reference_report)
detector, engine = (Task(name, ("MyOversubscriptionDetector",), DETECTOR, _reference_detector,
                         decisions=answer_of("observe")) for name in ("detector", "engine"))
TASKS, NEAR = [report, detector, engine], close(1e-9, 1e-9)
check_report, check_detector, check_engine = report.grade, detector.grade, engine.grade


# ---- the report, by hand -------------------------------------------------------------------------
def _metrics(rng: random.Random, records: int = 0, steps=(), ttft_none: int = 0, **counters) -> EngineMetrics:
    """``records`` request records drawn from ``rng`` (every other one preempted; ``ttft_none`` with no ttft)."""
    m = EngineMetrics(**counters)
    for i in range(records):
        preempted = rng.choice([1, 2, 3]) if i % 2 else 0
        ttft = None if i < ttft_none else round(rng.uniform(0.05, 2), 3)
        m.requests[f"req-{i}"] = RequestMetrics(f"req-{i}", 0.0, ttft, (ttft or 0) + 1, preempted,
                                                round(rng.uniform(0.01, 0.1) * (1 + preempted), 4), 8)
    m.steps.extend(step_record(i, preemptions) for i, preemptions in enumerate(steps))
    return m


def _part(report_fn, metrics: EngineMetrics, key: str, window: int = 16):
    out = report_fn(metrics, window)
    expect(isinstance(out, dict) and key in out, f"the report has no {key!r} key: it is {out!r}"[:300])
    return out[key]


@report.check(1, "preemptions_per_finished_request is num_preemptions / num_finished (counters: the whole run); "
                 "preempted_share is the share of the records in metrics.requests preempted at least once", NEAR)
def rate_and_share(fn, rng: random.Random) -> dict:
    kept, total = rng.randint(4, 10), rng.randint(3, 30)
    m = _metrics(rng, kept, num_preemptions=total, num_finished=kept + rng.randint(1, 5),
                 num_preemptions_recompute=rng.randint(0, total - 1))
    return {f"{m.num_preemptions} preemptions, {m.num_finished} finished, {kept} records kept: {key}":
            _part(fn, m, key) for key in ("preemptions_per_finished_request", "preempted_share")}


@report.check(1, "worst_stutter maps 'preempted' and 'not_preempted' to the largest max_inter_token_latency in "
                 "each group of requests, None for a group with no request", NEAR)
def stutter_by_group(fn, rng: random.Random) -> dict:
    return {f"worst_stutter of {n} drawn records": _part(fn, _metrics(rng, n, num_finished=n), "worst_stutter")
            for n in (rng.randint(5, 12), 1)}


@report.check(1, "median_ttft maps 'preempted' and 'not_preempted' to statistics.median of each group's ttft, "
                 "skipping a ttft of None; None for a group with no ttft", NEAR)
def ttft_by_group(fn, rng: random.Random) -> dict:
    return {f"median_ttft of {n} drawn records, {none} with no ttft": _part(
        fn, _metrics(rng, n, ttft_none=none, num_finished=n), "median_ttft")
        for n, none in ((rng.randint(6, 12), rng.randint(1, 3)), (2, 0), (4, 0), (2, 1))}


@report.check(2, "busiest_window is the most preemptions in any `window` consecutive steps of metrics.timeline "
                 "(num_preemptions of each StepRecord); with fewer steps, all of them; 0 with none")
def busiest_window(fn, rng: random.Random) -> dict:
    steps = [rng.choice([0, 0, 0, 1, 2, 3]) for _ in range(rng.randint(10, 16))]
    steps[-1] += 5  # the busiest window is the last one
    seen = {f"busiest_window of {steps} with window={w}": _part(fn, _metrics(rng, 3, steps, num_finished=3),
                                                                  "busiest_window", w)
            for w in sorted({1, 2, rng.randint(3, 6), len(steps) - 1, len(steps), len(steps) + rng.randint(1, 9)})}
    one = [rng.randint(1, 4)]  # a measurement of one step
    seen.update({f"busiest_window of {one} with window={w}": _part(fn, _metrics(rng, 1, one, num_finished=1),
                                                                   "busiest_window", w) for w in (1, 4)})
    seen["busiest_window of an empty timeline"] = _part(fn, _metrics(rng, 2, num_finished=2), "busiest_window", 4)
    return seen


@report.check(1, "recomputed_share is num_recomputed_tokens over every token the model ran: prompt, generated "
                 "and recomputed tokens", NEAR)
def recomputed_share(fn, rng: random.Random) -> dict:
    counts = dict(num_prompt_tokens=rng.randint(50, 500), num_generated_tokens=rng.randint(50, 900),
                  num_recomputed_tokens=rng.randint(1, 400))
    return {f"recomputed_share of {counts}": _part(fn, _metrics(rng, 4, num_finished=4, **counts), "recomputed_share")}


@report.check(1, "before anything has run the report still answers: 0.0 for the rate and the recomputed share, 0 "
                 "for the busiest window, None for the share and for every group of requests (nothing to divide)")
def nothing_yet(fn, rng: random.Random) -> dict:
    window = rng.randint(1, 32)
    return {f"the report of an engine that has served nothing, window={window}": fn(EngineMetrics(), window)}


@report.check(2, "pass the checks above first; on a real run the timeline and the request records are long and "
                 "the engine's history may drop old ones: read what metrics holds, nothing else", NEAR)
def report_on_a_real_run(fn, rng: random.Random) -> dict:
    window, metrics = rng.randint(2, 20), copy.deepcopy(_recorded("oversubscribed", rng.randrange(10**6)).metrics)
    for r in metrics.requests.values():  # wall-clock times differ from run to run: drawn instead
        r.ttft, r.max_inter_token_latency = r.ttft and round(rng.uniform(0.05, 2), 3), round(rng.uniform(0.01, 0.5), 4)
    return {f"the report of an oversubscribed run, window={window}": fn(metrics, window)}


# ---- the detector, on made-up runs ---------------------------------------------------------------
@detector.check(1, "judge only on enough evidence: with fewer than 8 finished requests, say nothing, however "
                   "preempted they were; with 8, judge")
def quiet_on_thin_evidence(cls, rng: random.Random) -> dict:
    run = [rng.randint(2, 5) for _ in range(rng.randint(1, 7))]
    return {f"warnings on {run}": len(replay_run(cls(), run)), "warnings on 8 requests preempted 3 times each":
            len(replay_run(cls(), [3] * 8))}


@detector.check(1, "a server whose requests are each preempted more than once is oversubscribed: warn as soon as "
                   "enough of them finished; requests preempted once or less are not")
def warns_when_oversubscribed(cls, rng: random.Random) -> dict:
    runs = [[rng.randint(2, 5) for _ in range(24)], [rng.choice([0, 1, 1]) for _ in range(24)]]
    rng.shuffle(runs)  # which run is oversubscribed is drawn, and so is every answer
    return {f"on {run}, warned by the time 12 had finished": [n <= 12 for n, _ in replay_run(cls(), run)][:1] for run in runs}


@detector.check(2, "the question is whether the server is oversubscribed now: a long calm start must not hide "
                   "that recent requests are preempted again and again (a whole-run average would)")
def judges_recent_requests(cls, rng: random.Random) -> dict:
    calm, late = rng.randint(40, 60), [rng.randint(3, 4) for _ in range(16)]
    warned = [n for n, _ in replay_run(cls(), [0] * calm + late)]
    return {f"{calm} requests never preempted, then {late}: warned during the calm start": any(n <= calm for n in warned),
            "warned within the last 16": any(n > calm for n in warned)}


@detector.check(1, "occasional preemption is the price of paging, not a capacity problem: one unlucky request, "
                   "or a rate of one per request or less, is no alarm")
def quiet_on_occasional_preemption(cls, rng: random.Random) -> dict:
    phase = rng.randrange(4)
    run = [1 if i % 4 == phase else 0 for i in range(80)]
    run[rng.randint(20, 60)] = 5
    return {f"warnings on {run}": len(replay_run(cls(), run)),
            "warnings on 40 requests each preempted exactly once": len(replay_run(cls(), [1] * 40))}


@detector.check(1, "warn once: the engine calls observe after every step, and an alarm every step is noise")
def warns_once(cls, rng: random.Random) -> dict:
    run = [rng.randint(2, 5) for _ in range(60)]
    return {f"warnings on {run}": len(replay_run(cls(), run))}


@detector.check(1, "the warning says what to change: more KV capacity (num_gpu_blocks) or less concurrency "
                   "(max_num_seqs), and how bad it is (the rate you measured)")
def says_what_to_change(cls, rng: random.Random) -> dict:
    run = [rng.randint(2, 5) for _ in range(16)]
    messages = [w for _, w in replay_run(cls(), run)][:1]
    return {f"on {run}, a warning that is a str naming num_gpu_blocks, max_num_seqs and a number": [
        [isinstance(w, str), "num_gpu_blocks" in str(w), "max_num_seqs" in str(w), any(c.isdigit() for c in str(w))]
        for w in messages]}


# ---- the detector in the engine -------------------------------------------------------------------
CONFIG = dict(block_size=4, preemption_mode="recompute", watermark=0.0, max_num_seqs=32, device="cpu")
LATE_START, MAX_STEPS = 30, 2000


def _workload(name: str, seed: int) -> tuple[dict, list[Arrival]]:
    """16 requests growing to 8 blocks at once; 24 short, then 16 long at step 30; 40, one in six long."""
    rng = random.Random(seed)
    prompt, grows = (lambda: tuple(random_tokens(rng, 8))), (lambda n: SamplingParams(max_tokens=n, ignore_eos=True))
    arrivals = {"oversubscribed": (burst := [Arrival(0, prompt(), grows(24)) for _ in range(16)]), "roomy": burst,
                "late": [Arrival(i, prompt(), grows(4)) for i in range(24)]
                + [Arrival(LATE_START, prompt(), grows(24)) for _ in range(16)],
                "occasional": [Arrival(2 * i, prompt(), grows(24 if i % 6 == 0 else 8)) for i in range(40)]}[name]
    return dict(CONFIG, num_gpu_blocks=512 if name == "roomy" else 20), arrivals


_recorded = cache(lambda workload, seed: serve_watched(None, *_workload(workload, seed), MAX_STEPS))


def watch(detector_cls, workload: str, seed: int = 0) -> Watched:
    """``detector_cls()`` on a workload: plugged in when oversubscribed, else replayed on the run served once."""
    return (serve_watched(detector_cls(), *_workload(workload, seed), MAX_STEPS) if workload == "oversubscribed"
            else replay_watched(detector_cls(), _recorded(workload, seed)))


@engine.check(2, "pass the detector checks first; a pool too small from the start must be flagged once, while "
                 "it is happening (by the time 10 of its 16 requests have finished)")
def warns_once_when_oversubscribed(cls, rng: random.Random) -> dict:
    served = watch(cls, "oversubscribed", rng.randrange(10**6))
    return {"16 requests at once in 20 blocks: warnings": len(served.warnings),
            "the first by the time 10 had finished": [w[0] <= 10 for w in served.warnings][:1]}


@engine.check(1, "a run that never preempts must never warn")
def quiet_with_room(cls, rng: random.Random) -> dict:
    return {"16 requests in 512 blocks: warnings": len(watch(cls, "roomy", rng.randrange(10**6)).warnings)}


@engine.check(2, "judge recent requests, not the whole run: after a long light stretch, oversubscription that "
                 "starts late must still be flagged")
def warns_on_late_onset(cls, rng: random.Random) -> dict:
    steps = [w[1] for w in watch(cls, "late", rng.randrange(10**6)).warnings]
    return {f"24 light requests, 16 long ones at step {LATE_START}: warnings in the light stretch":
            sum(s < LATE_START for s in steps), "warnings after it": sum(s >= LATE_START for s in steps)}


@engine.check(1, "a few preemptions spread over a stream of requests are no alarm")
def quiet_on_a_stream_with_occasional_preemption(cls, rng: random.Random) -> dict:
    served = watch(cls, "occasional", rng.randrange(10**6))
    return {f"40 requests, {served.metrics.num_preemptions} preemptions: warnings": len(served.warnings)}
