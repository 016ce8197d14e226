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
    from kvlib.invariants import InvariantError, check_invariants

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
