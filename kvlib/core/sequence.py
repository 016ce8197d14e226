"""A sequence: one stream of tokens with its place in the KV cache and its life in the scheduler.

A request with ``n`` samples starts as one sequence; after its prompt is computed, the other
``n - 1`` samples fork from it and share its blocks. Each sample draws from its own random
stream, derived from the request's seed and the sample's index, so seeded samples come out the
same whatever else runs beside them.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

import torch

from kvlib.config import SamplingParams
from kvlib.core.block_table import BlockTable

_seq_ids = itertools.count()


def new_seq_id() -> int:
    """The next sequence id: ids grow in the order sequences are made, in every process alike."""
    return next(_seq_ids)


class SequenceStatus(Enum):
    WAITING = "waiting"  # not yet prefilled, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: some of its blocks are in the host pool
    FINISHED = "finished"  # done, aborted or rejected: it holds no blocks


def sample_stream_seed(seed: int, sample_index: int) -> int:
    """The 64-bit seed of sample ``sample_index`` of a request seeded ``seed``.

    A hash, not ``seed + sample_index``: requests seeded 0 and 1 with n = 2 would otherwise
    share a stream (sample 1 of the first and sample 0 of the second).
    """
    if sample_index == 0:
        return seed % 2**64  # a request's first sample draws exactly like an n = 1 request with the same seed
    digest = hashlib.blake2b(f"{seed}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(eq=False)  # identity: two sequences are never the same because their fields match
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    arrival_time: float
    seed: Optional[int] = None  # the request's seed (SamplingParams.seed, or one the engine derived)
    sample_index: int = 0
    seq_id: int = field(default_factory=lambda: new_seq_id())
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # leading tokens whose K/V are in the device cache
    peak_computed_tokens: int = 0  # most ever computed: anything below it is computed again after a drop
    host_blocks: list[int] = field(default_factory=list)  # swapped-out blocks, in order, after the device ones
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache names of its leading full blocks
    pending_forks: int = 0  # samples still to fork from this one once its prompt is computed
    finish_reason: Optional[str] = None
    # measurements
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    max_inter_token_latency: float = 0.0
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.block_table = BlockTable(self.block_size)
        self.generator = None
        if not self.params.greedy:
            self.generator = torch.Generator().manual_seed(sample_stream_seed(self.seed or 0, self.sample_index))
        if self.sample_index == 0 and not self.output_token_ids:
            self.pending_forks = self.params.n - 1

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_slots(self) -> int:
        """Places among ``max_num_seqs`` this sequence takes: itself and the samples it will fork."""
        return 1 + self.pending_forks

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def spawn_sample(self, sample_index: int) -> "Sequence":
        """Sample ``sample_index`` of the same request, to continue from this one's computed prompt."""
        return Sequence(self.request_id, list(self.prompt_token_ids), self.params, self.block_size,
                        self.arrival_time, self.seed, sample_index)

    def record_token(self, token_id: int, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.max_inter_token_latency = max(self.max_inter_token_latency, now - self.last_token_time)
        self.last_token_time = now
        self.output_token_ids.append(token_id)
