"""Lab 09 checks: the learner's preemption report and oversubscription detector, by hand and in the engine.

``preemption_report(metrics, window)`` turns :class:`~kvlib.metrics.EngineMetrics` into the numbers
lesson 08 reads. kvlib has no such report, so the reference is written here (:func:`_reference_report`,
hidden while grading, as is ``EngineMetrics.summary``); each check builds metrics from the seed, one
quantity per check, and a last one reads an oversubscribed run.

``MyOversubscriptionDetector().observe(metrics)`` must say, once, when the server is oversubscribed
*now*. kvlib's :class:`~kvlib.oversubscription.OversubscriptionDetector` judges the whole run (hidden
while grading); the reference is a detector over the last 16 finished requests (:func:`_reference_detector`,
hidden too). The checks observe what any correct design answers (whether and when it warned, how
often, what the warning names), on made-up runs replayed as the engine calls it and on four engine
workloads: oversubscribed from the start (the detector plugged in), with room, light and then
oversubscribed late, and occasionally preempted (served once, every state replayed to the detector).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, fields
from functools import cache
from typing import Optional

from kvlib.config import SamplingParams
from kvlib.course.grading.checks import Task, close, expect
from kvlib.course.grading.workloads import Arrival, serve_timed
from kvlib.metrics import EngineMetrics, RequestMetrics, StepRecord


def _reference_report():
    import statistics

    def preemption_report(metrics: EngineMetrics, window: int = 16) -> dict:
        records = list(metrics.requests.values())
        groups = {"preempted": [r for r in records if r.num_preemptions],
                  "not_preempted": [r for r in records if not r.num_preemptions]}
        steps = [s.num_preemptions for s in metrics.timeline]
        work = metrics.num_prompt_tokens + metrics.num_generated_tokens + metrics.num_recomputed_tokens
        return {"preemptions_per_finished_request": metrics.num_preemptions / metrics.num_finished
                if metrics.num_finished else 0.0,
                "preempted_share": len(groups["preempted"]) / len(records) if records else None,
                "worst_stutter": {k: max((r.max_inter_token_latency for r in g), default=None) for k, g in groups.items()},
                "median_ttft": {k: statistics.median(t) if (t := [r.ttft for r in g if r.ttft is not None]) else None
                                for k, g in groups.items()},
                "busiest_window": max(sum(steps[i:i + window]) for i in range(max(1, len(steps) - window + 1)))
                if steps else 0,
                "recomputed_share": metrics.num_recomputed_tokens / work if work else 0.0}
    return preemption_report


def _reference_detector():
    from collections import deque

    class RecentRequests:
        def __init__(self, threshold: float = 1.0):
            self.threshold, self.recent, self.seen, self.warned = threshold, deque(maxlen=16), 0, False

        def observe(self, metrics: EngineMetrics) -> Optional[str]:
            new, self.seen = metrics.num_finished - self.seen, metrics.num_finished
            records = list(metrics.requests.values())
            self.recent.extend(r.num_preemptions for r in (records[-new:] if new > 0 else []))
            if self.warned or len(self.recent) < 8 or (rate := sum(self.recent) / len(self.recent)) <= self.threshold:
                return None
            self.warned = True
            return f"oversubscribed: {rate:.1f} preemptions per request; raise num_gpu_blocks or lower max_num_seqs"
    return RecentRequests


DETECTOR = ("kvlib.oversubscription:OversubscriptionDetector", "kvlib.course.grading.lab09:_reference_detector")
report = Task("report", ("preemption_report",), ("kvlib.course.grading.lab09:_reference_report",
                                                 "kvlib.metrics:EngineMetrics.summary"), _reference_report)
detector = Task("detector", ("MyOversubscriptionDetector",), DETECTOR, _reference_detector)
engine = Task("engine", ("MyOversubscriptionDetector",), DETECTOR, _reference_detector)
TASKS = [report, detector, engine]
check_report, check_detector, check_engine = report.grade, detector.grade, engine.grade
NEAR = close(1e-9, 1e-9)


# ---- the report, by hand -------------------------------------------------------------------------
def _step(number: int, preemptions: int) -> StepRecord:
    return StepRecord(number, 0.01, 0.01 * number, 10, 16, 0, 16, 2, 0, 0, 4, preemptions)


def _metrics(rng: random.Random, records: int = 0, steps=(), ttft_none: int = 0, **counters) -> EngineMetrics:
    """``records`` request records drawn from ``rng`` (about half preempted; ``ttft_none`` with no ttft)."""
    m = EngineMetrics(**counters)
    for i in range(records):
        preempted = rng.choice([0, 0, 1, 2, 3])
        ttft = None if i < ttft_none else round(rng.uniform(0.05, 2), 3)
        m.requests[f"req-{i}"] = RequestMetrics(f"req-{i}", 0.0, ttft, (ttft or 0) + 1, preempted,
                                                round(rng.uniform(0.01, 0.1) * (1 + preempted), 4), 8)
    for i, preemptions in enumerate(steps):
        m.steps.append(_step(i, preemptions))
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
                 num_preemptions_recompute=rng.randint(0, total))
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
    return {f"the report of an engine that has served nothing, window={w}": fn(EngineMetrics(), w)
            for w in (rng.randint(1, 32),)}


@report.check(2, "pass the checks above first; on a real run the timeline and the request records are long and "
                 "the engine's history may drop old ones: read what metrics holds, nothing else", NEAR)
def report_on_a_real_run(fn, rng: random.Random) -> dict:
    window, metrics = rng.randint(2, 20), _recorded("oversubscribed", rng.randrange(10**6)).metrics
    return {f"the report of an oversubscribed run, window={window}": fn(metrics, window)}


# ---- the detector, on made-up runs ---------------------------------------------------------------
def replay_run(detector_obj, preemptions_per_request: list[int]) -> list[tuple[int, str]]:
    """Feed ``detector_obj`` a made-up run as the engine would, after every step, one metrics object that grows:
    request ``i`` finishes at step ``i``, preempted ``preemptions_per_request[i]`` times. (finished, warning)s."""
    m, warnings = EngineMetrics(), []
    for i, preempted in enumerate(preemptions_per_request):
        m.num_preemptions += preempted
        m.requests[f"r{i}"] = RequestMetrics(f"r{i}", 0.0, 0.1, 1.0, preempted, 0.05 * (1 + preempted), 8)
        m.num_finished += 1
        seen = (m.num_preemptions, m.num_finished, list(m.requests), len(m.steps))
        answer = detector_obj.observe(m)
        expect((m.num_preemptions, m.num_finished, list(m.requests), len(m.steps)) == seen,
               "observe changed the metrics it was given; it may only read them")
        warnings += [(m.num_finished, answer)] if answer else []
        m.record_step(_step(i, preempted))
    return warnings


def _heavy(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(2, 5) for _ in range(n)]


@detector.check(1, "judge only on enough evidence: with fewer than 8 finished requests, say nothing, however "
                   "preempted they were; with 8, judge")
def quiet_on_thin_evidence(cls, rng: random.Random) -> dict:
    run = _heavy(rng, rng.randint(1, 7))
    return {f"warnings on {run}": len(replay_run(cls(), run)), "warnings on 8 requests preempted 3 times each":
            len(replay_run(cls(), [3] * 8))}


@detector.check(1, "a server whose requests are each preempted more than once is oversubscribed: warn as soon as "
                   "enough of them finished")
def warns_when_oversubscribed(cls, rng: random.Random) -> dict:
    run = _heavy(rng, 24)
    return {f"on {run}, warned by the time 12 had finished": [n <= 12 for n, _ in replay_run(cls(), run)][:1]}


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
    run = _heavy(rng, 60)
    return {f"warnings on {run}": len(replay_run(cls(), run))}


@detector.check(1, "the warning says what to change: more KV capacity (num_gpu_blocks) or less concurrency "
                   "(max_num_seqs), and how bad it is (the rate you measured)")
def says_what_to_change(cls, rng: random.Random) -> dict:
    run = _heavy(rng, 16)
    messages = [w for _, w in replay_run(cls(), run)][:1]
    return {f"on {run}, a warning that is a str naming num_gpu_blocks, max_num_seqs and a number": [
        [isinstance(w, str), "num_gpu_blocks" in str(w), "max_num_seqs" in str(w), any(c.isdigit() for c in str(w))]
        for w in messages]}


# ---- the detector in the engine -------------------------------------------------------------------
CONFIG = dict(block_size=4, preemption_mode="recompute", watermark=0.0, max_num_seqs=32, device="cpu")
LATE_START = 30
MAX_STEPS = 2000


def _workload(name: str, seed: int) -> tuple[list[Arrival], int]:
    """16 requests growing to 8 blocks at once in 20 blocks (or 512); 24 short ones one a step, then 16 long at
    step 30; 40 one every 2 steps, one in six long. Only the tokens are drawn."""
    rng = random.Random(seed)
    prompt, grows = (lambda: tuple(rng.randrange(3, 253) for _ in range(8))), (lambda n: SamplingParams(
        max_tokens=n, ignore_eos=True))
    burst = [Arrival(0, prompt(), grows(24)) for _ in range(16)]
    return {"oversubscribed": (burst, 20), "roomy": (burst, 512),
            "late": ([Arrival(i, prompt(), grows(4)) for i in range(24)]
                     + [Arrival(LATE_START, prompt(), grows(24)) for _ in range(16)], 20),
            "occasional": ([Arrival(2 * i, prompt(), grows(24 if i % 6 == 0 else 8)) for i in range(40)], 20)}[name]


class _Tape:
    """A detector that never warns and records every state of the metrics it is shown, to replay to others."""

    SCALARS = [f.name for f in fields(EngineMetrics) if f.name not in ("history", "requests", "steps")]

    def __init__(self):
        self.entries, self.step, self.requests, self.steps = [], 0, 0, 0

    def observe(self, metrics: EngineMetrics):
        records, steps = list(metrics.requests.values()), list(metrics.steps)
        self.entries.append((self.step, {k: getattr(metrics, k) for k in self.SCALARS},
                             records[self.requests:] if len(records) >= self.requests else records, steps[self.steps:]))
        self.requests, self.steps = len(records), len(steps)


@dataclass
class Served:
    warnings: list  # (finished requests, engine step, warning)
    metrics: EngineMetrics
    tape: Optional[list] = None


def _live(detector_cls, workload: str, seed: int) -> Served:
    """Serve a workload with ``detector_cls()`` plugged into the engine (None: a tape recorder)."""
    import logging

    from kvlib import LLM, EngineConfig

    arrivals, blocks = _workload(workload, seed)
    inner, warnings, step = detector_cls() if detector_cls else _Tape(), [], [0]

    class Recording:
        def observe(self, metrics):
            inner.step = step[0]
            answer = inner.observe(metrics)
            warnings.extend([(metrics.num_finished, step[0], answer)] if answer else [])
            return answer
    llm = LLM("default", EngineConfig(num_gpu_blocks=blocks, **CONFIG), oversubscription_detector=Recording(),
              verbose=False)
    level = logging.getLogger("kvlib").level
    logging.getLogger("kvlib").setLevel(logging.ERROR)  # the warnings are counted here
    try:
        serve_timed(llm, arrivals, MAX_STEPS, before_step=lambda s: step.__setitem__(0, s))
    finally:
        logging.getLogger("kvlib").setLevel(level)
    return Served(warnings, llm.metrics, None if detector_cls else inner.entries)


_recorded = cache(lambda workload, seed: _live(None, workload, seed))


def watch(detector_cls, workload: str, seed: int = 0) -> Served:
    """``detector_cls()`` on a workload: plugged in when oversubscribed from the start, else replayed call by
    call on the run served once (a detector only reads the metrics, so the run does not depend on it)."""
    if workload == "oversubscribed":
        return _live(detector_cls, workload, seed)
    recorded = _recorded(workload, seed)
    m, detector_obj, warnings = EngineMetrics(history=recorded.metrics.history), detector_cls(), []
    for step, counters, records, steps in recorded.tape:
        m.__dict__.update(counters)
        m.requests.update((r.request_id, r) for r in records)
        m.steps.extend(steps)
        answer = detector_obj.observe(m)
        warnings += [(m.num_finished, step, answer)] if answer else []
    return Served(warnings, recorded.metrics)


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
def quiet_on_occasional_preemption(cls, rng: random.Random) -> dict:
    served = watch(cls, "occasional", rng.randrange(10**6))
    return {f"40 requests, {served.metrics.num_preemptions} preemptions: warnings": len(served.warnings)}
