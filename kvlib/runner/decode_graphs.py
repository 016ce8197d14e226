"""Decode steps replayed from CUDA graphs: a step of small kernels costs one launch instead of hundreds.

A decode step of a 30-layer model launches a few hundred kernels, each doing microseconds of work,
so at small batches the GPU waits on the host launching them. A CUDA graph records one step's
launches once and replays them with a single call. What the graph recorded is fixed: the addresses
it reads, the sizes, and every value the host computed while recording. So:

- inputs live in the persistent buffers of :class:`~kvlib.runner.step_inputs.InputBuffers`; a replay only
  rewrites their contents;
- there is one graph per batch-size bucket (1, 2, 4, 8, then multiples of 16, as nano-vllm does),
  and a batch is padded up to its bucket with chunks that store nothing;
- the metadata's host-side numbers are the bucket's, not the step's: ``max_context_len`` is the
  engine's ``max_model_len``, so the decode kernel's split *count* is the bucket's
  (``choose_num_splits``), while each sequence's split *length* is worked out in the kernel from
  its own context, so a batch of short contexts still spreads over every split (splits a short
  context cannot fill return at once);
- only a backend whose decode reads nothing back to the host may be captured: one that declares
  ``capabilities.graph_safe`` (the Triton one; ``graph_safe``);
- a graph ends at the last layer's hidden states, ``[bucket, hidden]``; the language-model head
  runs after the replay on the sampled rows only, so no graph keeps a ``[bucket, vocab]`` output.

Capturing goes through a seam: ``CudaGraphCapture`` records a real graph; its CPU twin,
``EagerCapture``, "replays" by calling the recorded function again on the same buffers and the same
metadata object. That twin keeps exactly what a graph would keep, values computed on the host at
capture time included, so tests on a CPU check that replays read only the buffers.
"""
from __future__ import annotations

from typing import Callable

import torch

from kvlib.runner.step_inputs import PADDING, Chunk, InputBuffers

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs``."""
    buckets = [b for b in SMALL_BUCKETS if b < max_num_seqs] + list(range(BUCKET_STEP, max_num_seqs, BUCKET_STEP))
    return buckets + [max_num_seqs]


class CudaGraphCapture:
    """Records CUDA graphs that share one memory pool (captured largest first, so the smaller ones fit in it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None

    def capture(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        step()  # run once outside the graph: kernels compiled and libraries initialized before recording
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay


class EagerCapture:
    """The CPU twin: recording runs the step once, as recording a graph does; replaying runs it again, on the
    same buffers and metadata."""

    def capture(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        step()
        return step


def graph_safe(backend) -> bool:
    """Whether a backend may be captured: it says so itself (``capabilities.graph_safe``)."""
    return backend.capabilities.graph_safe


class DecodeGraphs:
    """One recorded decode step per bucket, over ``buffers``; ``run`` replays the smallest bucket that fits."""

    def __init__(self, model, pool, backend, buffers: InputBuffers, max_model_len: int, buckets: list[int], capture):
        self.model, self.buffers, self.max_model_len = model, buffers, max_model_len
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        for bucket in sorted(buckets, reverse=True):
            inputs = self._pack([], bucket)

            def step(inputs=inputs) -> torch.Tensor:
                return model.hidden_states(inputs.token_ids, inputs.positions, pool, inputs.meta, backend)
            self.replays[bucket] = capture.capture(step)

    @property
    def largest(self) -> int:
        return max(self.replays)

    def run(self, chunks: list[Chunk]) -> torch.Tensor:
        """Logits ``[sampled chunks, vocab]`` of a decode step of at most ``largest`` single-token chunks."""
        bucket = min(b for b in self.replays if b >= len(chunks))
        inputs = self._pack(chunks, bucket)
        return self.model.logits(self.replays[bucket]().index_select(0, inputs.logits_rows))

    def _pack(self, chunks: list[Chunk], bucket: int):
        return self.buffers.pack(chunks or [PADDING], max_context_len=self.max_model_len, pad_to=bucket)
