"""Streams and events: how the copy of KV blocks overlaps the model's work on a GPU, behind a small seam.

On CUDA the model runs on the compute stream (whatever stream is current) and block transfers
between the device and the pinned host pool run on a dedicated copy stream; events order the two
without the host waiting: the compute stream waits for a swap-in to land, and a buffer is
overwritten only after the event of its last reader. On a CPU there is one stream of work, the
program itself: ``HostStreams`` runs the same calls in program order, where every event has
already happened. Tests drive the transfer code through that twin (and through a twin that logs
the calls), so the CUDA ordering is checked on machines without a GPU.
"""
from __future__ import annotations

import contextlib

import torch


class HostEvent:
    """An event on the CPU: the work before it is done by the time anyone can ask."""

    def synchronize(self) -> None:
        pass


class HostStream:
    """The CPU twin of a stream: work issued "on" it simply runs now, in program order."""

    def __enter__(self) -> "HostStream":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def record(self) -> HostEvent:
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

    def record(self) -> CudaEvent:
        event = torch.cuda.Event()
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
