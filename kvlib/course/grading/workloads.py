"""Requests that arrive while the engine runs: the driver behind the engine checks of labs 07 and 09.

``serve_timed`` adds each request at the engine step its arrival names, with an arrival time of
its own (requests are ordered by arrival time, so a request can join the queue ahead of those
already running), checks the block bookkeeping after every step, and returns every output with
the step at which its request finished.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional

from kvlib.course.grading.checks import CheckFailed

_ids = itertools.count()  # request ids unique across calls on one engine


@dataclass(frozen=True)
class Arrival:
    """One request: added before engine step ``step`` (counting from 0), ordered by ``arrival_time``."""

    step: int
    prompt: tuple[int, ...]
    params: object  # SamplingParams
    arrival_time: Optional[float] = None  # None: when it is added
    name: str = ""  # its request id (unique in one run); "" for one made up


@dataclass
class Served:
    outputs: list  # RequestOutput, in the order of the arrivals
    finished_at: list[int]  # engine step (counting from 0) at which each request finished
    num_steps: int


def serve_timed(llm, arrivals: list[Arrival], max_steps: int,
                before_step: Optional[Callable[[int], None]] = None) -> Served:
    """Serve ``arrivals`` step by step on ``llm``; fail the check if bookkeeping breaks or requests stall."""
    from kvlib.core.invariants import InvariantError, check_invariants

    engine = llm.engine
    pending = sorted(enumerate(arrivals), key=lambda item: item[1].step)
    ids = [a.name or f"timed-{next(_ids)}" for a in arrivals]
    finished: dict[str, tuple[object, int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if step == max_steps:
            raise CheckFailed(f"requests were still unfinished after {max_steps} engine steps")
        while pending and pending[0][1].step <= step:
            index, arrival = pending.pop(0)
            engine.add_request(ids[index], list(arrival.prompt), arrival.params, arrival_time=arrival.arrival_time)
        if before_step is not None:
            before_step(step)
        if engine.has_unfinished_requests():
            finished.update((out.request_id, (out, step)) for out in engine.step() if out.finished)
            try:
                check_invariants(engine)
            except InvariantError as exc:
                raise CheckFailed(f"after engine step {step + 1}: {exc}") from exc
        step += 1
    return Served([finished[i][0] for i in ids], [finished[i][1] for i in ids], step)


# ---- a detector watching a run (lab 09) ------------------------------------------------------------
@dataclass
class Watched:
    warnings: list  # (finished requests, engine step, warning)
    metrics: object  # EngineMetrics at the end
    tape: Optional[list] = None  # every state of the metrics observe was shown, when recorded


class _Tape:
    """A detector that never warns and records every state of the metrics it is shown, to replay to others;
    ``clock[0]`` is the step it is shown them at (the harness's counter, so nothing is set on a detector)."""

    def __init__(self, clock: list[int]):
        self.clock, self.entries, self.requests, self.steps = clock, [], 0, 0

    @property
    def step(self) -> int:
        return self.clock[0]

    def observe(self, metrics):
        from dataclasses import fields
        records, steps = list(metrics.requests.values()), list(metrics.steps)
        scalars = {f.name: getattr(metrics, f.name) for f in fields(metrics)
                   if f.name not in ("history", "requests", "steps")}
        self.entries.append((self.step, scalars, records[self.requests:] if len(records) >= self.requests else records,
                             steps[self.steps:]))
        self.requests, self.steps = len(records), len(steps)


def serve_watched(detector, config: dict, arrivals: list[Arrival], max_steps: int) -> Watched:
    """Serve ``arrivals`` with ``detector`` plugged into the engine (None: a recorder of what it would see)."""
    import logging

    from kvlib import LLM, EngineConfig

    step, warnings = [0], []
    inner = detector if detector is not None else _Tape(step)

    class Recording:
        def observe(self, metrics):
            answer = inner.observe(metrics)
            warnings.extend([(metrics.num_finished, step[0], answer)] if answer else [])
            return answer
    llm = LLM("default", EngineConfig(**config), oversubscription_detector=Recording(), verbose=False)
    log = logging.getLogger("kvlib")
    level = log.level
    log.setLevel(logging.ERROR)  # the warnings are counted here; the grader's log stays readable
    try:
        serve_timed(llm, arrivals, max_steps, before_step=lambda s: step.__setitem__(0, s))
    finally:
        log.setLevel(level)
    return Watched(warnings, llm.metrics, inner.entries if detector is None else None)


def replay_watched(detector, recorded: Watched) -> Watched:
    """What ``detector`` answers on a recorded run, shown the same metrics call by call as if plugged in."""
    from kvlib.metrics import EngineMetrics

    m, warnings = EngineMetrics(history=recorded.metrics.history), []
    for step, counters, records, steps in recorded.tape:
        m.__dict__.update(counters)
        m.requests.update((r.request_id, r) for r in records)
        m.steps.extend(steps)
        answer = detector.observe(m)
        warnings += [(m.num_finished, step, answer)] if answer else []
    return Watched(warnings, recorded.metrics)


# ---- made-up runs (lab 09) ------------------------------------------------------------------------
def step_record(number: int, preemptions: int):
    """A made-up StepRecord of engine step ``number`` with ``preemptions`` preemptions."""
    from kvlib.metrics import StepRecord
    return StepRecord(number, 0.01, 0.01 * number, 10, 16, 0, 16, 2, 0, 0, 4, preemptions)


def replay_run(detector_obj, preemptions_per_request: list[int]) -> list[tuple[int, str]]:
    """Feed ``detector_obj`` a made-up run as the engine would, after every step, one metrics object that grows:
    request ``i`` finishes at step ``i``, preempted ``preemptions_per_request[i]`` times. (finished, warning)s."""
    from kvlib.metrics import EngineMetrics, RequestMetrics

    m, warnings = EngineMetrics(), []
    for i, preempted in enumerate(preemptions_per_request):
        m.num_preemptions += preempted
        m.requests[f"r{i}"] = RequestMetrics(f"r{i}", 0.0, 0.1, 1.0, preempted, 0.05 * (1 + preempted), 8)
        m.num_finished += 1
        seen = (m.num_preemptions, m.num_finished, list(m.requests), len(m.steps))
        answer = detector_obj.observe(m)
        if (m.num_preemptions, m.num_finished, list(m.requests), len(m.steps)) != seen:
            raise CheckFailed("observe changed the metrics it was given; it may only read them")
        warnings += [(m.num_finished, answer)] if answer else []
        m.record_step(step_record(i, preempted))
    return warnings

