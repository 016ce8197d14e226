"""The one thread that owns the engine: it adds and aborts requests between steps, steps, and hands out outputs.

The engine is not thread-safe, and it need not be: every call into it happens on this thread. The
HTTP side only puts commands in an inbox (add, abort, end on a stop string, probe, or a function to
run between steps) and reads events from the queue each request brought. A request's events, in
order: ``accepted`` (after the first step that follows its add, when the engine did not reject it),
then one ``output`` per step that gave it tokens, the last one finished; or a single ``error`` (a
rejection, or a step that raised).

A step that raises fails every live request with that error (a 500 for the client, never a hang)
and aborts them, so their blocks go back; the loop then waits for the next request. Until a step
succeeds again ``last_error`` holds the failure; ``probe`` asks whether the engine steps now (what
``/health`` asks, so that a readiness probe, which sends no traffic, sees the engine recover).
``stop`` ends every live request with an error (503) and then the thread; after it, an abort has
nothing to do and a submit gets its error event at once, so no caller ever waits or raises.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from kvlib.llm import LLM
from kvlib.outputs import RequestOutput
from kvlib.config import SamplingParams

logger = logging.getLogger("kvlib.serve")


@dataclass(frozen=True)
class EngineEvent:
    kind: str  # "accepted", "output", "error"; "closed": the HTTP side closed the request itself
    output: Optional[RequestOutput] = None
    error: Optional[str] = None
    status: int = 200  # for an error: 400 (the request's fault) or 500 (the engine's)


Sink = Callable[[EngineEvent], None]  # called on the engine thread; must only hand the event over
SHUTTING_DOWN = "the server is shutting down"
ADDS_PER_STEP = 256  # requests added between two steps at most: a burst waits its turn, the streams keep their pace
PROBE_PROMPT = [0]  # a probe's prompt: one token, valid in every vocabulary
PROBE_PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)


class LoopObserver:
    """What the loop reports as it goes (``kvlib.serve.prometheus.ServerMetrics`` records it); by default nothing."""

    def first_token(self, seconds: float) -> None: ...
    def token_gap(self, seconds: float) -> None: ...
    def finished(self, seconds: float, finished_reason: str) -> None: ...
    def engine_changed(self, llm: LLM) -> None: ...
    def uncounted(self, counts: dict[str, float]) -> None:
        """What the engine's metrics counted (by field) that the server reports otherwise: the loop's own probe,
        which no client asked for, and the abort that ends a request on a stop string, which finished it."""


@dataclass
class _Live:
    """A request the loop holds: where its events go, and its timing as the server sees it."""

    sink: Sink
    submitted: float
    last_token: Optional[float] = None
    tokens: list[int] = field(default_factory=list)  # tokens seen so far, per sample


class EngineLoop:
    def __init__(self, llm: LLM, observer: Optional[LoopObserver] = None):
        self.llm = llm
        self.observer = observer or LoopObserver()
        self.last_error: Optional[str] = None  # the last step's failure, until a step succeeds again
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._live: dict[str, _Live] = {}
        self._probes: list[concurrent.futures.Future] = []  # answered after the next step, or by a probe of its own
        self._probe_ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="kvlib-engine-loop", daemon=True)

    # ---- called from any thread ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End every live request (an error event, status 503) and stop the thread; later calls do nothing."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._refuse_inbox()  # a command sent while the thread was ending

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, sink: Sink) -> None:
        """Queue a request; once the loop is stopping, its one event is an error (503) instead."""
        if not self.alive:
            sink(EngineEvent("error", error=SHUTTING_DOWN, status=503))
            return
        self._send(("add", request_id, prompt, params, sink))

    def abort(self, request_id: str) -> None:
        """Abort a request; once the loop is stopping, nothing to do: stopping ends every request."""
        if self.alive:
            self._send(("abort", request_id))

    def end_stopped(self, request_id: str) -> None:
        """End a request whose every choice met a stop string (the engine stops on token ids only): its blocks go
        back as an abort's do, and it counts as finished with reason ``stop``, as vLLM counts it, not as aborted."""
        if self.alive:
            self._send(("stopped", request_id))

    def call(self, fn: Callable[[LLM], object]) -> concurrent.futures.Future:
        """Run ``fn(llm)`` on the engine thread between two steps (to inspect the engine safely)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, future))
        return future

    def probe(self) -> concurrent.futures.Future:
        """True once the engine has stepped without raising: the next step of the live requests, or, with none, a
        one-token request of the loop's own, alone (its tokens are counted nowhere). False if that step raised."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("probe", future))
        return future

    def _send(self, command: tuple) -> None:
        if not self.alive:
            raise RuntimeError("the engine loop is not running; start the server first")
        self._inbox.put(command)
        self._wake.set()

    # ---- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        self._observe_engine()
        while not self._stopping:
            self._wake.clear()
            added = self._drain_inbox()
            if self._probes and not self._live:
                self._probe_alone()
            if not self._live:
                if self._inbox.empty():
                    self._wake.wait()
                continue
            try:
                outputs = self.llm.engine.step()
            except Exception as exc:  # noqa: BLE001 - any failure must reach the clients, not kill the loop
                self._fail_all(_describe(exc))
                continue
            self.last_error = None
            self._answer_probes(True)
            self._observe_engine()  # first: a client that has its last token may scrape /metrics at once
            self._hand_out(outputs, added)
        logger.log(logging.WARNING if self._live else logging.INFO, "%s: ending %d open request(s) with an error",
                   SHUTTING_DOWN, len(self._live))
        self._fail_all(SHUTTING_DOWN, status=503)
        self._answer_probes(False)
        self._refuse_inbox()

    def _drain_inbox(self) -> list[str]:
        """Carry out the commands sent since the last step, in order, up to ``ADDS_PER_STEP`` adds: the rest wait
        for the next step. The ids of the requests the engine took."""
        added, adds = [], 0
        while adds < ADDS_PER_STEP:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return added
            kind = command[0]
            if kind == "add":
                adds += 1
                if self._add(*command[1:]):
                    added.append(command[1])
            elif kind in ("abort", "stopped"):
                self._abort(command[1], stopped=kind == "stopped")
            elif kind == "probe":
                self._probes.append(command[1])
            else:
                self._call(*command[1:])
        return added

    def _refuse_inbox(self) -> None:
        """After the loop stopped: what is still in the inbox gets an answer, never a wait."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                command[4](EngineEvent("error", error=SHUTTING_DOWN, status=503))
            elif command[0] == "call":
                command[2].set_exception(RuntimeError("the engine loop stopped"))
            elif command[0] == "probe":
                command[1].set_result(False)

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams, sink: Sink) -> bool:
        try:
            self.llm.engine.add_request(request_id, prompt, params)
        except (TypeError, ValueError) as exc:
            sink(EngineEvent("error", error=str(exc), status=400))
            return False
        except Exception as exc:  # noqa: BLE001
            sink(EngineEvent("error", error=_describe(exc), status=500))
            return False
        self._live[request_id] = _Live(sink, time.perf_counter())
        return True

    def _abort(self, request_id: str, stopped: bool = False) -> None:
        """Abort a live request; ``stopped``: it met its stop strings, so it counts as finished (``stop``), not aborted.
        A request no longer live was finished by the engine first (its own reason counted) or already aborted."""
        live = self._live.pop(request_id, None)
        if live is None:
            return
        aborted = self.llm.metrics.num_aborted
        self.llm.engine.abort_request(request_id)
        if stopped:
            self.observer.uncounted({"num_aborted": self.llm.metrics.num_aborted - aborted})
            self.observer.finished(time.perf_counter() - live.submitted, "stop")
        self._observe_engine()

    def _probe_alone(self) -> None:
        """Nothing is live: step a one-token request of the loop's own to learn whether the engine steps now."""
        engine, before = self.llm.engine, _counters(self.llm.metrics)
        request_id = f"kvlib-health-probe-{next(self._probe_ids)}"
        try:
            engine.add_request(request_id, PROBE_PROMPT, PROBE_PARAMS)
            while engine.has_unfinished_requests():
                engine.step()
        except Exception as exc:  # noqa: BLE001 - the failure is the probe's answer
            self.last_error = _describe(exc)
            logger.error("%s (a health probe's own request)", self.last_error)
            try:
                engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the engine already failed; its own error is the answer
                pass
        else:
            self.last_error = None
        after = _counters(self.llm.metrics)
        self.observer.uncounted({name: after[name] - before[name] for name in before})
        self._observe_engine()
        self._answer_probes(self.last_error is None)

    def _answer_probes(self, stepped: bool) -> None:
        probes, self._probes = self._probes, []
        for future in probes:
            future.set_result(stepped)

    def _call(self, fn, future: concurrent.futures.Future) -> None:
        try:
            future.set_result(fn(self.llm))
        except BaseException as exc:  # noqa: BLE001 - the caller's function; its error is the caller's
            future.set_exception(exc)

    def _hand_out(self, outputs: list[RequestOutput], added: list[str]) -> None:
        now = time.perf_counter()
        rejected = {out.request_id for out in outputs if out.rejected}
        for request_id in added:
            live = self._live.get(request_id)
            if live is not None and request_id not in rejected:
                live.sink(EngineEvent("accepted"))
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if out.rejected:
                del self._live[out.request_id]
                live.sink(EngineEvent("error", error=out.error, status=400))
                continue
            self._time_tokens(live, out, now)
            live.sink(EngineEvent("output", output=out))
            if out.finished:
                del self._live[out.request_id]
                if not out.aborted:  # an aborted one is counted once, by the engine's num_aborted
                    self.observer.finished(now - live.submitted, request_finish_reason(out))

    def _time_tokens(self, live: _Live, out: RequestOutput, now: float) -> None:
        counts = [len(s.token_ids) for s in out.samples]
        if counts == live.tokens or not any(counts):  # no token yet: aborted before its first
            return
        if live.last_token is None:
            self.observer.first_token(now - live.submitted)
        else:
            self.observer.token_gap(now - live.last_token)
        live.last_token, live.tokens = now, counts

    def _observe_engine(self) -> None:
        try:
            self.observer.engine_changed(self.llm)
        except Exception:  # noqa: BLE001 - a metrics failure must not stop serving
            logger.exception("recording the engine's metrics failed")

    def _fail_all(self, message: str, status: int = 500) -> None:
        if status == 500:
            self.last_error = message
            logger.error("%s; failing %d live request(s)", message, len(self._live))
        live, self._live = self._live, {}
        for request_id, request in live.items():
            request.sink(EngineEvent("error", error=message, status=status))
            try:
                self.llm.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the engine already failed; its own error was reported
                logger.exception("aborting %s after the engine failed raised too", request_id)
        self._answer_probes(False)
        self._observe_engine()


def request_finish_reason(output: RequestOutput) -> str:
    """One reason for a whole request, as ``vllm:request_success`` counts requests, not samples: ``length`` if any
    of its samples was cut at max_tokens, else the first sample's (``stop``)."""
    reasons = [sample.finish_reason or "stop" for sample in output.samples]
    return "length" if "length" in reasons else reasons[0]


def _counters(metrics) -> dict[str, float]:
    return {name: value for name, value in vars(metrics).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def _describe(exc: BaseException) -> str:
    return f"the engine failed: {type(exc).__name__}: {exc}"
