"""What attention needs to know about one engine step, besides the tensors themselves."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable, Optional

import torch


@dataclass
class AttentionMetadata:
    """A step's tokens, packed: sequence ``i`` owns query rows ``query_start[i] .. query_start[i+1]-1``.

    Those rows are the last ``query_len`` positions of a sequence that is ``context_lens[i]`` tokens
    long once this step's K/V are stored, so row ``r`` of sequence ``i`` sits at position
    ``p = context_lens[i] - query_len + r`` and attends causally to positions ``0 .. p``; with a
    ``sliding_window`` of ``w`` only to the last ``w`` of them, ``max(0, p - w + 1) .. p``
    (Mistral's convention, as transformers implements it).

    The model runner packs single-token sequences (decodes) first and says how many in
    ``num_decodes``, so a backend can send them to a decode kernel without looking at the lengths;
    0 claims nothing, and every sequence may then be treated as a prefill.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot for each new token's K/V, -1 to skip
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    context_lens: torch.Tensor  # [num_seqs] int32
    query_start: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_context_len: int  # at least every context length (a bound: the runner may pass a larger one)
    sliding_window: Optional[int] = None  # None: full causal attention
    num_decodes: int = 0  # the first num_decodes sequences have one query row each
    derived: dict = field(default_factory=dict, repr=False, compare=False)  # see ``derive``

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be None or at least 1, got {self.sliding_window}")

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    def derive(self, key: str, build: Callable[[], Any]) -> Any:
        """A value a backend computes from this step's metadata once and reuses in every layer."""
        if key not in self.derived:
            self.derived[key] = build()
        return self.derived[key]

    @cached_property
    def host_lengths(self) -> tuple[list[int], list[int]]:
        """``(query_lens, context_lens)`` as Python lists, read from the device once per step, not per layer."""
        starts = self.query_start.tolist()
        return [b - a for a, b in zip(starts, starts[1:])], self.context_lens.tolist()

    @cached_property
    def decode_part(self) -> AttentionMetadata:
        """The first ``num_decodes`` sequences (views, one query row each)."""
        n = self.num_decodes
        return replace(self, slot_mapping=self.slot_mapping[:n], block_tables=self.block_tables[:n],
                       context_lens=self.context_lens[:n], query_start=self.query_start[:n + 1], max_query_len=1,
                       num_decodes=n, derived={})

    @cached_property
    def prefill_part(self) -> AttentionMetadata:
        """The sequences after the decodes, their query rows counted from 0: new tensors, so kernels see the
        same alignment whatever the number of decodes before them."""
        n = self.num_decodes
        return replace(self, slot_mapping=self.slot_mapping[n:], block_tables=self.block_tables[n:],
                       context_lens=self.context_lens[n:].clone(), query_start=self.query_start[n:] - n,
                       num_decodes=0, derived={})
