"""Lab 09 checks: the learner's preemption report and oversubscription detector, by hand and in the engine.

``preemption_report(metrics, window)`` turns :class:`~kvlib.metrics.EngineMetrics` into the numbers
lesson 08 reads: preemptions per finished request, the share of requests preempted, stutter and time
to first token of preempted requests next to the others, the busiest run of steps on the timeline, and
the share of the model's work spent recomputing. Its checks build metrics by hand, one quantity per
check, then compare the report of a real oversubscribed run with the grader's own computation.

``MyOversubscriptionDetector().observe(metrics)`` must say, once, when the server is oversubscribed
*now*. Its unit checks replay made-up runs the way the engine calls it (after every step, with the
same metrics object growing), so a design over recent requests, over recent steps or over counter
deltas is judged on what it answers, not on how. The engine checks serve four workloads: one
oversubscribed from the start, one with room, one that is light for a long time and then
oversubscribed (a whole-run average never crosses the threshold there), and one with occasional
preemptions that is never oversubscribed. The first runs with the learner's detector plugged into
the engine; the other three are served once per process with every state the detector would be
shown recorded, and replayed to it call by call (a detector only reads the metrics, so the run does
not depend on it), which keeps a class's grading to seconds.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from functools import cache
from typing import Optional

from kvlib.config import SamplingParams
from kvlib.course.grading.checks import CheckFailed, Task, expect
from kvlib.course.grading.extract import Rules
from kvlib.course.grading.results import TaskResult
from kvlib.course.grading.workloads import Arrival, serve_timed
from kvlib.metrics import EngineMetrics, RequestMetrics, StepRecord

METRICS_IMPORTS = {"kvlib.metrics": {"EngineMetrics", "RequestMetrics", "StepRecord"}}
report = Task("report", Rules(needs=("preemption_report",), kvlib_imports=METRICS_IMPORTS))
DETECTOR_RULES = Rules(needs=("MyOversubscriptionDetector",), kvlib_imports=METRICS_IMPORTS,
                       own_methods=("observe",))
detector = Task("detector", DETECTOR_RULES)
engine = Task("engine", DETECTOR_RULES)
TASKS = [report, detector, engine]

REMEDIES = ("num_gpu_blocks", "max_num_seqs")
THRESHOLD = 1.0  # preemptions per finished request above which a server is oversubscribed
MIN_EVIDENCE = 8  # finished requests a judgement needs


def check_report(report_fn) -> TaskResult:
    return report.grade(report_fn)


def check_detector(detector_cls) -> TaskResult:
    return detector.grade(detector_cls)


def check_engine(detector_cls) -> TaskResult:
    return engine.grade(detector_cls)


def _refuse_summary() -> dict:
    raise CheckFailed("the report called metrics.summary(), kvlib's own report: compute each number from the "
                      "counters, metrics.requests and metrics.timeline yourself")


def _guarded(metrics: EngineMetrics) -> EngineMetrics:
    metrics.summary = _refuse_summary  # an instance attribute: kvlib's report is not the answer
    return metrics


# ---- the report, by hand -------------------------------------------------------------------------
def _request(name: str, preemptions: int, ttft: Optional[float], stutter: float) -> RequestMetrics:
    return RequestMetrics(name, 0.0, ttft, (ttft or 0.0) + 1.0, preemptions, stutter, 8)


def _step(number: int, preemptions: int) -> StepRecord:
    return StepRecord(number, 0.01, 0.01 * number, 10, 16, 0, 16, 2, 0, 0, 4, preemptions)


def _metrics(records: list[RequestMetrics] = (), steps: list[int] = (), **counters) -> EngineMetrics:
    m = EngineMetrics(**counters)
    for r in records:
        m.requests[r.request_id] = r
    for i, preemptions in enumerate(steps):
        m.steps.append(_step(i, preemptions))
    return _guarded(m)


SIX = [_request("a", 0, 0.10, 0.02), _request("b", 2, 0.50, 0.30), _request("c", 0, 0.20, 0.05),
       _request("d", 1, 0.70, 0.25), _request("e", 0, 0.40, 0.04), _request("f", 3, 0.90, 0.60)]
NO_TTFT = _request("g", 1, None, 0.10)  # preempted before its first token, and aborted: no ttft


def _field(report_fn, metrics: EngineMetrics, key: str, window: int = 16):
    out = report_fn(metrics, window)
    expect(isinstance(out, dict), f"preemption_report returned {type(out).__name__}; expected a dict")
    expect(key in out, f"the report has no {key!r} key; it has {sorted(out)}")
    return out[key]


def _expect_close(got, want, what: str) -> None:
    if want is None or isinstance(want, int):
        expect(got == want, f"{what}: got {got!r}, expected {want!r}")
        return
    expect(isinstance(got, (int, float)) and abs(got - want) <= 1e-9 * max(1.0, abs(want)),
           f"{what}: got {got!r}, expected {want!r}")


@report.check(1, "preemptions_per_finished_request is num_preemptions / num_finished (counters: the whole run); "
                 "preempted_share is the share of the records in metrics.requests preempted at least once")
def rate_and_share(report_fn) -> None:
    m = _metrics(SIX, num_preemptions=9, num_finished=8)  # the history kept 6 of the 8 records
    _expect_close(_field(report_fn, m, "preemptions_per_finished_request"), 9 / 8,
                  "9 preemptions over 8 finished requests (6 records kept), preemptions_per_finished_request")
    _expect_close(_field(report_fn, m, "preempted_share"), 0.5, "3 of the 6 records preempted, preempted_share")


@report.check(1, "worst_stutter maps 'preempted' and 'not_preempted' to the largest max_inter_token_latency in "
                 "each group of requests, None for a group with no request")
def stutter_by_group(report_fn) -> None:
    got = _field(report_fn, _metrics(SIX, num_finished=6), "worst_stutter")
    expect(isinstance(got, dict) and set(got) == {"preempted", "not_preempted"},
           f"worst_stutter is {got!r}; expected a dict with keys 'preempted' and 'not_preempted'")
    _expect_close(got["preempted"], 0.60, "worst stutter of the preempted requests (0.30, 0.25, 0.60)")
    _expect_close(got["not_preempted"], 0.05, "worst stutter of the others (0.02, 0.05, 0.04)")
    calm = _field(report_fn, _metrics(SIX[:1], num_finished=1), "worst_stutter")
    _expect_close(calm.get("preempted", "missing"), None, "no preempted request, worst_stutter['preempted']")


@report.check(1, "median_ttft maps 'preempted' and 'not_preempted' to statistics.median of each group's ttft, "
                 "skipping a ttft of None; None for a group with no ttft")
def ttft_by_group(report_fn) -> None:
    got = _field(report_fn, _metrics(SIX + [NO_TTFT], num_finished=7), "median_ttft")
    expect(isinstance(got, dict) and set(got) == {"preempted", "not_preempted"},
           f"median_ttft is {got!r}; expected a dict with keys 'preempted' and 'not_preempted'")
    _expect_close(got["preempted"], 0.70, "median TTFT of the preempted requests (0.50, 0.70, 0.90 and one None)")
    _expect_close(got["not_preempted"], 0.20, "median TTFT of the others (0.10, 0.20, 0.40)")
    even = _field(report_fn, _metrics(SIX[:2] + SIX[3:4], num_finished=3), "median_ttft")
    _expect_close(even["preempted"], 0.60, "median TTFT of two preempted requests (0.50, 0.70)")
    none = _field(report_fn, _metrics(SIX[:1] + [NO_TTFT], num_finished=2), "median_ttft")
    _expect_close(none["preempted"], None, "one preempted request with no ttft, median_ttft['preempted']")


@report.check(2, "busiest_window is the most preemptions in any `window` consecutive steps of metrics.timeline "
                 "(num_preemptions of each StepRecord); with fewer steps, all of them; 0 with none")
def busiest_window(report_fn) -> None:
    steps = [0, 2, 0, 0, 3, 1, 0, 0, 0, 4, 0, 1]
    for window, want in ((1, 4), (3, 5), (4, 5), (5, 6), (12, 11), (40, 11)):
        m = _metrics(SIX, steps=steps, num_preemptions=11, num_finished=6)
        _expect_close(_field(report_fn, m, "busiest_window", window), want,
                      f"preemptions per step {steps}, busiest_window with window={window}")
    m = _metrics(SIX, num_finished=6)
    _expect_close(_field(report_fn, m, "busiest_window", 4), 0, "an empty timeline, busiest_window")


@report.check(1, "recomputed_share is num_recomputed_tokens over every token the model ran: prompt, generated "
                 "and recomputed tokens")
def recomputed_share(report_fn) -> None:
    m = _metrics(SIX, num_finished=6, num_prompt_tokens=300, num_generated_tokens=500, num_recomputed_tokens=200)
    _expect_close(_field(report_fn, m, "recomputed_share"), 0.2,
                  "300 prompt, 500 generated and 200 recomputed tokens, recomputed_share")


@report.check(1, "before anything has run the report still answers: 0.0 for the rate and the recomputed share, 0 "
                 "for the busiest window, None for the share and for every group of requests (nothing to divide)")
def nothing_yet(report_fn) -> None:
    got = report_fn(_metrics(), 16)
    want = {"preemptions_per_finished_request": 0.0, "preempted_share": None,
            "worst_stutter": {"preempted": None, "not_preempted": None},
            "median_ttft": {"preempted": None, "not_preempted": None}, "busiest_window": 0, "recomputed_share": 0.0}
    expect(got == want, f"the report of an engine that has served nothing is {got!r}; expected {want!r}")


def reference_report(metrics: EngineMetrics, window: int = 16) -> dict:
    """The grader's own computation of the report (not kvlib's: kvlib has none of these groupings)."""
    records = list(metrics.requests.values())
    groups = {"preempted": [r for r in records if r.num_preemptions], "not_preempted":
              [r for r in records if not r.num_preemptions]}
    steps = [s.num_preemptions for s in metrics.steps]
    sums = [sum(steps[i:i + window]) for i in range(max(1, len(steps) - window + 1))]
    work = metrics.num_prompt_tokens + metrics.num_generated_tokens + metrics.num_recomputed_tokens
    return {
        "preemptions_per_finished_request": metrics.num_preemptions / metrics.num_finished if metrics.num_finished
        else 0.0,
        "preempted_share": len(groups["preempted"]) / len(records) if records else None,
        "worst_stutter": {k: max((r.max_inter_token_latency for r in g), default=None) for k, g in groups.items()},
        "median_ttft": {k: statistics.median(t) if (t := [r.ttft for r in g if r.ttft is not None]) else None
                        for k, g in groups.items()},
        "busiest_window": max(sums) if steps else 0,
        "recomputed_share": metrics.num_recomputed_tokens / work if work else 0.0,
    }


@report.check(2, "pass the checks above first; on a real run the timeline and the request records are long and "
                 "the engine's history may drop old ones: read what metrics holds, nothing else")
def report_on_a_real_run(report_fn) -> None:
    metrics = _guarded(_live(None, "oversubscribed").metrics)
    want = reference_report(metrics, 8)
    got = report_fn(metrics, 8)
    expect(isinstance(got, dict), f"preemption_report returned {type(got).__name__}; expected a dict")
    for key, value in want.items():
        expect(key in got, f"the report of a real run has no {key!r} key")
        if isinstance(value, dict):
            expect(isinstance(got[key], dict), f"{key}: got {got[key]!r}, expected a dict like {value!r}")
            for part, v in value.items():
                _expect_close(got[key].get(part, "missing"), v, f"oversubscribed run ({metrics.num_finished} requests, "
                                                                f"{metrics.num_steps} steps), {key}[{part!r}]")
        else:
            _expect_close(got[key], value, f"oversubscribed run ({metrics.num_finished} requests, "
                                           f"{metrics.num_steps} steps), {key}")


# ---- the detector, on made-up runs ---------------------------------------------------------------
def replay_run(detector_obj, preemptions_per_request: list[int]) -> list[tuple[int, str]]:
    """Feed ``detector_obj`` a made-up run as the engine would: after every step, one metrics object that grows.

    Request ``i`` finishes at step ``i`` and was preempted ``preemptions_per_request[i]`` times, counted in
    that step (so the counters, the request records and the timeline agree). Returns (finished requests,
    warning) for each warning, and fails if ``observe`` changes the metrics.
    """
    m = _guarded(EngineMetrics())
    warnings = []
    for i, preempted in enumerate(preemptions_per_request):
        m.num_preemptions += preempted
        m.requests[f"r{i}"] = RequestMetrics(f"r{i}", 0.0, 0.1, 1.0, preempted, 0.05 * (1 + preempted), 8)
        m.num_finished += 1
        seen = (m.num_preemptions, m.num_finished, list(m.requests), len(m.steps))
        answer = detector_obj.observe(m)
        expect((m.num_preemptions, m.num_finished, list(m.requests), len(m.steps)) == seen,
               "observe changed the metrics it was given; it may only read them")
        if answer:
            warnings.append((m.num_finished, answer))
        m.record_step(_step(i, preempted))
    return warnings


def _expect_warnings(cls, run: list[int], expected: str, what: str, within: Optional[tuple[int, int]] = None) -> list:
    warnings = replay_run(cls(), run)
    shown = [(n, w if len(w) < 60 else w[:57] + "...") for n, w in warnings]
    if expected == "none":
        expect(not warnings, f"{what}: your detector warned {shown[:1]} (after that many finished requests); "
                             f"expected no warning")
    elif expected == "once":
        expect(len(warnings) == 1, f"{what}: your detector warned {len(warnings)} times {shown[:3]}; expected once")
    else:  # "first": when the first warning came is what counts
        expect(warnings, f"{what}: your detector never warned")
        if within:
            first, last = within
            expect(first <= warnings[0][0] <= last, f"{what}: your detector warned when {warnings[0][0]} requests "
                                                    f"had finished; expected between {first} and {last}")
    return warnings


@detector.check(1, "judge only on enough evidence: with fewer than 8 finished requests, say nothing, however "
                   "preempted they were")
def quiet_on_thin_evidence(cls) -> None:
    _expect_warnings(cls, [4] * 7, "none", "7 requests finished, each preempted 4 times")


@detector.check(1, "a server whose requests are each preempted more than once is oversubscribed: warn as soon as "
                   "enough of them finished")
def warns_when_oversubscribed(cls) -> None:
    _expect_warnings(cls, [2] * 24, "first", "24 requests, each preempted twice", within=(8, 12))


@detector.check(2, "the question is whether the server is oversubscribed now: a long calm start must not hide "
                   "that recent requests are preempted again and again (a whole-run average would)")
def judges_recent_requests(cls) -> None:
    _expect_warnings(cls, [0] * 48 + [3] * 16, "first",
                     "48 requests never preempted, then 16 preempted 3 times each (whole run: 0.75 per request)",
                     within=(49, 64))


@detector.check(1, "occasional preemption is the price of paging, not a capacity problem: one unlucky request, "
                   "or a rate of one per request or less, is no alarm")
def quiet_on_occasional_preemption(cls) -> None:
    run = [1 if i % 4 == 0 else 0 for i in range(80)]
    run[40] = 5
    _expect_warnings(cls, run, "none", "80 requests, one in four preempted once and request 40 five times")
    _expect_warnings(cls, [1] * 40, "none", "40 requests, each preempted exactly once (not more than once)")


@detector.check(1, "warn once: the engine calls observe after every step, and an alarm every step is noise")
def warns_once(cls) -> None:
    _expect_warnings(cls, [3] * 60, "once", "60 requests, each preempted 3 times")


@detector.check(1, "the warning says what to change: more KV capacity (num_gpu_blocks) or less concurrency "
                   "(max_num_seqs), and how bad it is (the rate you measured)")
def says_what_to_change(cls) -> None:
    message = _expect_warnings(cls, [3] * 16, "first", "16 requests, each preempted 3 times")[0][1]
    expect(isinstance(message, str), f"the detector returned {message!r}; expected a str")
    missing = [name for name in REMEDIES if name not in message]
    expect(not missing, f"the warning {message!r} does not mention {' or '.join(missing)}")
    expect(any(ch.isdigit() for ch in message), f"the warning {message!r} gives no number: say the rate you saw")


# ---- the detector in the engine -------------------------------------------------------------------
def _tokens(seed: int, length: int) -> tuple[int, ...]:
    return tuple((7 * seed + 3 * j + 1) % 250 + 3 for j in range(length))


def _grows(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, ignore_eos=True)


CONFIG = dict(block_size=4, preemption_mode="recompute", watermark=0.0, max_num_seqs=32, device="cpu")
# 16 requests that each grow to 8 blocks, all at once, in 20 blocks: preempted about 1.5 times each.
BURST = tuple(Arrival(0, _tokens(i, 8), _grows(24)) for i in range(16))
# 24 short requests, one a step, that fit; then 16 long ones at once at step 30.
LATE_START = 30
LATE = tuple([Arrival(i, _tokens(i, 8), _grows(4)) for i in range(24)]
             + [Arrival(LATE_START, _tokens(60 + i, 8), _grows(24)) for i in range(16)])
# 40 requests, one every 2 steps, one in six long: some preemptions, never one per request for long.
STREAM = tuple(Arrival(2 * i, _tokens(i, 8), _grows(24 if i % 6 == 0 else 8)) for i in range(40))
WORKLOADS = {"oversubscribed": (BURST, 20), "roomy": (BURST, 512), "late": (LATE, 20), "occasional": (STREAM, 20)}
MAX_STEPS = 2000


class _Recording:
    """The learner's detector as the engine sees it, keeping every warning with the step it came."""

    def __init__(self, inner):
        self.inner = inner
        self.warnings: list[tuple[int, int, str]] = []  # (finished requests, engine step, warning)
        self.step = 0

    def observe(self, metrics: EngineMetrics):
        if isinstance(self.inner, _Tape):
            self.inner.step = self.step
        answer = self.inner.observe(metrics)
        if answer:
            self.warnings.append((metrics.num_finished, self.step, answer))
        return answer


@dataclass
class Served:
    warnings: list  # (finished requests, engine step, warning)
    metrics: EngineMetrics
    tape: Optional[list] = None  # every state observe was shown, for a run recorded to replay


@cache
def _live(detector_cls, workload: str) -> Served:
    """Serve one workload with ``detector_cls()`` plugged into the engine (None: one that never warns)."""
    import logging

    from kvlib import LLM, EngineConfig

    arrivals, blocks = WORKLOADS[workload]
    recording = _Recording(detector_cls() if detector_cls is not None else _Tape())
    llm = LLM("default", EngineConfig(num_gpu_blocks=blocks, **CONFIG), oversubscription_detector=recording,
              verbose=False)
    llm.metrics.summary = _refuse_summary
    engine_log = logging.getLogger("kvlib")
    level = engine_log.level
    engine_log.setLevel(logging.ERROR)  # the warnings are counted here; the grader's log stays readable
    try:
        serve_timed(llm, list(arrivals), MAX_STEPS, before_step=lambda step: setattr(recording, "step", step))
    finally:
        engine_log.setLevel(level)
    del llm.metrics.summary
    return Served(recording.warnings, llm.metrics, recording.inner.entries if detector_cls is None else None)


def _replayed(detector_cls, workload: str) -> Served:
    """What ``detector_cls()`` answers on a workload's recorded run: the same metrics, call by call.

    A detector only reads the metrics, so the engine's run does not depend on it: it is served once
    (``_live(None, ...)``), every state ``observe`` saw recorded, and any detector replayed on it sees
    exactly what it would see plugged in.
    """
    recorded = _live(None, workload)
    m = _guarded(EngineMetrics(history=recorded.metrics.history))
    detector_obj, warnings = detector_cls(), []
    for step, counters, records, steps in recorded.tape:
        m.__dict__.update(counters)
        for r in records:
            m.requests[r.request_id] = r
        m.steps.extend(steps)
        seen = (m.num_preemptions, m.num_finished, len(m.requests), len(m.steps))
        answer = detector_obj.observe(m)
        expect((m.num_preemptions, m.num_finished, len(m.requests), len(m.steps)) == seen,
               "observe changed the metrics it was given; it may only read them")
        if answer:
            warnings.append((m.num_finished, step, answer))
    return Served(warnings, recorded.metrics)


def _served(detector_cls, workload: str) -> Served:
    """The oversubscribed workload with the detector plugged into the engine; the others replayed."""
    return _live(detector_cls, workload) if workload == "oversubscribed" else _replayed(detector_cls, workload)


def watch(detector_cls, workload: str) -> Served:
    """Serve one of ``WORKLOADS`` with ``detector_cls()`` watching: its warnings (finished requests, engine
    step, text) and the run's metrics."""
    return _served(detector_cls, workload)


class _Tape:
    """Records every state of the metrics that ``observe`` is shown, to replay to other detectors."""

    SCALARS = [f.name for f in fields(EngineMetrics) if f.name not in ("history", "requests", "steps")]

    def __init__(self):
        self.entries = []
        self.step = 0
        self._requests = 0
        self._steps = 0

    def observe(self, metrics: EngineMetrics):
        records = list(metrics.requests.values())
        new_records = records[self._requests:] if len(records) >= self._requests else records
        steps = list(metrics.steps)
        self.entries.append((self.step, {k: getattr(metrics, k) for k in self.SCALARS}, new_records,
                             steps[self._steps:]))
        self._requests, self._steps = len(records), len(steps)
        return None


def _describe(served: Served) -> str:
    m = served.metrics
    return f"{m.num_preemptions} preemptions over {m.num_finished} requests in {m.num_steps} steps"


@engine.check(2, "pass the detector checks first; a pool too small from the start must be flagged once, while "
                 "it is happening (by the time 10 of its 16 requests have finished)")
def warns_once_when_oversubscribed(cls) -> None:
    served = _served(cls, "oversubscribed")
    n = len(served.warnings)
    expect(n == 1, f"{_describe(served)} (16 requests at once in 20 blocks): your detector warned {n} times; "
                   f"expected once")
    finished = served.warnings[0][0]
    expect(finished <= 10, f"{_describe(served)}: your detector warned only after {finished} of 16 requests had "
                           f"finished; the pool was too small from the start")


@engine.check(1, "a run that never preempts must never warn")
def quiet_with_room(cls) -> None:
    served = _served(cls, "roomy")
    if served.warnings:
        expect(False, f"{_describe(served)} in 512 blocks, yet your detector warned: {served.warnings[0][2]!r}")


@engine.check(2, "judge recent requests, not the whole run: after a long light stretch, oversubscription that "
                 "starts late must still be flagged")
def warns_on_late_onset(cls) -> None:
    served = _served(cls, "late")
    early = [w for w in served.warnings if w[1] < LATE_START]
    expect(not early, f"your detector warned at step {early[0][1] if early else 0}, during the light stretch "
                      f"(no preemption before step {LATE_START})")
    m = served.metrics
    expect(served.warnings,
           f"24 light requests, then 16 long ones at step {LATE_START} in 20 blocks ({_describe(served)}, "
           f"{m.num_preemptions / m.num_finished:.2f} per request over the whole run): your detector never warned")


@engine.check(1, "a few preemptions spread over a stream of requests are no alarm")
def quiet_on_occasional_preemption(cls) -> None:
    served = _served(cls, "occasional")
    expect(served.metrics.num_preemptions > 0, "the occasional workload was meant to preempt a few times but did not")
    if served.warnings:
        expect(False, f"a stream of {served.metrics.num_finished} requests with {_describe(served)}: your detector "
                      f"warned {served.warnings[0][2]!r} when {served.warnings[0][0]} had finished")
