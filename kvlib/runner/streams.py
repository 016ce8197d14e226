"""Streams and events: how the copy of KV blocks overlaps the model's work on a GPU, behind a small seam.

On CUDA the model runs on the compute stream (whatever stream is current) and block transfers
between the device and the pinned host pool run on a dedicated copy stream; events order the two
without the host waiting: the compute stream waits for a swap-in to land, and a buffer is
overwritten only after the event of its last reader. On a CPU there is one stream of work, the
program itself: ``HostStreams`` runs the same calls in program order, where every event has
already happened. Tests drive the transfer code through that twin (and through a twin that logs
the calls), so the CUDA ordering is checked on machines without a GPU.

Events also time work: ``record(timing=True)`` gives an event that ``seconds_until`` a later one
measures from, on the device for CUDA (the copies' own time, not the host's time to issue them),
by the host's clock on the CPU, where issuing is doing. ``done()`` says whether the work before an
event has finished, so a time is read only once it is there, never by waiting for it.
"""
from __future__ import annotations

import contextlib
import time

import torch


class HostEvent:
    """An event on the CPU: the work before it is done by the time anyone can ask."""

    def __init__(self) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def done(self) -> bool:
        return True

    def seconds_until(self, later: "HostEvent") -> float:
        return later.time - self.time


class HostStream:
    """The CPU twin of a stream: work issued "on" it simply runs now, in program order."""

    def __enter__(self) -> "HostStream":
        return self

    def __exit__(self, *exc) -> None:
        pass

    handle = 0  # what the CUDA runtime would call the stream: none here

    def record(self, timing: bool = False) -> HostEvent:
        return HostEvent()

    def wait(self, event) -> None:
        pass


class HostStreams:
    def __init__(self) -> None:
        self.compute = HostStream()
        self.copy = HostStream()


class CudaEvent:
    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def synchronize(self) -> None:
        """The host waits for the work before the event (used only on buffers of an earlier step, long done)."""
        self.event.synchronize()

    def done(self) -> bool:
        return self.event.query()

    def seconds_until(self, later: "CudaEvent") -> float:
        """Device time from this event to ``later`` (both recorded with ``timing=True``, both done)."""
        return self.event.elapsed_time(later.event) / 1e3


class CudaStream:
    """A CUDA stream: ``with stream:`` issues the enclosed work on it."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None):
        self.device = device
        self.stream = stream  # None: whichever stream is current when used (the compute stream)
        self._context = contextlib.nullcontext()

    def _current(self) -> torch.cuda.Stream:
        return self.stream if self.stream is not None else torch.cuda.current_stream(self.device)

    def __enter__(self) -> "CudaStream":
        self._context = torch.cuda.stream(self._current())
        self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._context.__exit__(*exc)

    @property
    def handle(self) -> int:
        """The stream as the CUDA runtime names it (``cudaStream_t``), for calls made to it directly."""
        return self._current().cuda_stream

    def record(self, timing: bool = False) -> CudaEvent:
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self._current())
        return CudaEvent(event)

    def wait(self, event: CudaEvent) -> None:
        """Work issued on this stream after now starts only once ``event`` has happened (no host wait)."""
        self._current().wait_event(event.event)


class CudaStreams:
    def __init__(self, device: torch.device):
        self.compute = CudaStream(device)
        self.copy = CudaStream(device, torch.cuda.Stream(device))


def streams_for(device: torch.device) -> HostStreams | CudaStreams:
    return CudaStreams(device) if device.type == "cuda" else HostStreams()


class SpanTimer:
    """Times spans of work that run on both streams (a step's block moves), read only once they are done.

    ``start`` records on the compute stream before the work is issued, ``stop`` on both streams after;
    a span lasts until its later end. ``settled_seconds`` adds up the spans whose events have all
    happened and keeps the rest for a later call: on a GPU a step's moves are read after the step's
    own synchronization (its sampled tokens read back) and copies still crossing the link then are
    counted by a later step; on a CPU every span is done when it stops.
    """

    def __init__(self, streams) -> None:
        self.streams = streams
        self.pending: list[tuple[object, list]] = []

    def start(self):
        return self.streams.compute.record(timing=True)

    def stop(self, start) -> None:
        self.pending.append((start, [self.streams.compute.record(timing=True), self.streams.copy.record(timing=True)]))

    def settled_seconds(self) -> float:
        settled = [span for span in self.pending if all(end.done() for end in span[1])]
        self.pending = [span for span in self.pending if not any(span is s for s in settled)]
        return sum(max(0.0, *(start.seconds_until(end) for end in ends)) for start, ends in settled)
