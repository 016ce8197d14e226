"""A sequence: one stream of tokens with its place in the KV cache and its life in the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

import torch

from kvlib.block_table import BlockTable
from kvlib.config import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"  # not yet prefilled, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: some of its blocks are in the host pool
    FINISHED = "finished"


@dataclass(eq=False)  # identity: two sequences are never the same because their fields match
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    arrival_time: float
    generator: Optional[torch.Generator] = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # leading tokens whose K/V are in the device cache
    peak_computed_tokens: int = 0  # most ever computed: anything below it is computed again after a drop
    host_blocks: list[int] = field(default_factory=list)  # swapped-out tail, in order
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache names of its leading full blocks
    finish_reason: Optional[str] = None
    # measurements
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    max_inter_token_latency: float = 0.0
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.block_table = BlockTable(self.block_size)

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
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def record_token(self, token_id: int, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.max_inter_token_latency = max(self.max_inter_token_latency, now - self.last_token_time)
        self.last_token_time = now
        self.output_token_ids.append(token_id)
