"""What an attention backend declares about itself, so the engine asks it instead of testing its class."""
from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class BackendCapabilities:
    """A backend's answers to the questions start-up asks of it (``backend.capabilities``).

    ``graph_safe``: a decode step's ``forward`` only launches device work and reads nothing back to
    the host, so it may be recorded once in a CUDA graph and replayed, every host-side value frozen
    as it was when recorded (``kvlib.runner.decode_graphs``). ``dtypes``: the model dtypes it computes
    correctly; the engine refuses any other when it is built. ``warm_up_decode_bounds``: the
    ``max_context_len`` values at which a decode step launches a kernel variant of its own, compiled
    at its first launch; warm-up runs one decode step at each before serving (``kvlib.runner.warm_up``).
    Empty: one mixed step launches everything the backend will ever launch.
    """

    graph_safe: bool
    dtypes: tuple[torch.dtype, ...]
    warm_up_decode_bounds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.dtypes or not all(isinstance(d, torch.dtype) for d in self.dtypes):
            raise TypeError(f"BackendCapabilities.dtypes must name at least one torch.dtype, got {self.dtypes!r}")
