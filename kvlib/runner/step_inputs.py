"""A step's inputs, packed into buffers that live as long as the engine.

Every step needs the same few integer arrays: token ids, positions, cache slots and the logits rows
(int64), and per sequence its context length and its first query row (int32). They are written on
the host into two persistent buffers, one per integer type, each array a slice at an offset fixed
by the step's sizes, then moved to the device in two non-blocking copies from pinned memory. Fixed
addresses are what a CUDA graph needs to replay a step with new inputs, and on a CPU the same
buffers are used in place, with no copy.

Block tables have a fixed width, enough blocks for the longest sequence the engine admits (rounded
up to a multiple of 16 so that every row starts on a 64-byte boundary), so their shape and strides,
which Triton compiles its kernels for, never change from step to step. That width is 8,192 columns
at 128k tokens in blocks of 16, most of them zero, so the tables live in a buffer of their own,
row ``i`` for the step's ``i``-th sequence, kept from step to step: a step writes, and copies to the
device, only the columns of each row that differ from what the row held (a decode usually changes
none, or appends one block), and zeroes what a shorter table left behind, so every row is exactly
what a rebuild from zeros would give.

Single-token sequences (decodes) are packed first, so attention can give them to the decode
kernel as one slice (``AttentionMetadata.num_decodes``); the logits rows stay in the order of the
chunks, which is the plan's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvlib.attention.metadata import AttentionMetadata
from kvlib.runner.streams import HostStreams

TABLE_ALIGN = 16  # block table widths are multiples of this many entries
MERGE_GAP = 1024  # changed table spans closer than this many entries cross to the device as one copy


@dataclass
class Chunk:
    """The tokens one sequence computes in a step: positions ``start .. start + len(token_ids) - 1``."""

    token_ids: list[int]
    start: int
    block_table: list[int]  # the sequence's blocks, enough for its last position; none: store nothing (padding)
    sampled: bool  # its last token gets a logits row


PADDING = Chunk([0], 0, [], sampled=False)  # stores nothing and reads block 0: fills a CUDA graph's batch


@dataclass
class StepInputs:
    token_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [num_sampled] int64: packed row of each sampled chunk, in chunk order


def table_width(max_model_len: int, block_size: int) -> int:
    """Columns of every block table: enough for ``max_model_len`` positions, a multiple of ``TABLE_ALIGN``."""
    blocks = -(-max_model_len // block_size)
    return -(-blocks // TABLE_ALIGN) * TABLE_ALIGN


class InputBuffers:
    """The persistent buffers, sized for the largest step: ``max_num_tokens`` tokens of ``max_num_seqs`` sequences,
    for one pool's ``block_size`` and one model's ``sliding_window`` (None: attention sees every position)."""

    def __init__(self, max_num_tokens: int, max_num_seqs: int, width: int, device: torch.device, streams=None, *,
                 block_size: int, sliding_window: int | None = None):
        self.max_num_tokens, self.max_num_seqs, self.width = max_num_tokens, max_num_seqs, width
        self.block_size, self.sliding_window = block_size, sliding_window
        self.device = torch.device(device)
        self.streams = streams or HostStreams()
        pinned = self.device.type == "cuda"
        self.host64 = torch.zeros(3 * max_num_tokens + max_num_seqs, dtype=torch.int64, pin_memory=pinned)
        self.host32 = torch.zeros(2 * max_num_seqs + 1, dtype=torch.int32, pin_memory=pinned)
        self.host_tables = torch.zeros(max_num_seqs, width, dtype=torch.int32, pin_memory=pinned)
        self.np64, self.np32, self.np_tables = self.host64.numpy(), self.host32.numpy(), self.host_tables.numpy()
        self.table_lens = [0] * max_num_seqs  # columns of each row that may be non-zero
        on_host = self.device.type == "cpu"
        self.device64 = self.host64 if on_host else torch.zeros_like(self.host64, device=self.device)
        self.device32 = self.host32 if on_host else torch.zeros_like(self.host32, device=self.device)
        self.device_tables = self.host_tables if on_host else torch.zeros_like(self.host_tables, device=self.device)
        self.copied = self.streams.compute.record()  # after the last copy out of the host buffers

    def pack(self, chunks: list[Chunk], max_context_len: int | None = None, pad_to: int | None = None) -> StepInputs:
        """Write a step's chunks into the buffers and return the device views of them.

        ``max_context_len`` overrides the step's longest context with a bound, and ``pad_to`` adds
        ``PADDING`` chunks up to that many sequences: a CUDA graph's sizes and metadata must not
        change between replays.
        """
        chunks = chunks + [PADDING] * ((pad_to or 0) - len(chunks))
        num_seqs, num_tokens = len(chunks), sum(len(c.token_ids) for c in chunks)
        if num_seqs > self.max_num_seqs or num_tokens > self.max_num_tokens:
            raise ValueError(f"a step of {num_tokens} tokens in {num_seqs} sequences is larger than the input "
                             f"buffers ({self.max_num_tokens} tokens, {self.max_num_seqs} sequences)")
        decodes = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        order = decodes + [i for i, c in enumerate(chunks) if len(c.token_ids) != 1]
        self.copied.synchronize()  # the previous step's copies have left the host buffers (long ago)
        n64 = self._pack_tokens([chunks[i] for i in order], num_tokens)
        rows = np.cumsum([len(chunks[i].token_ids) for i in order]) - 1  # last row of each packed chunk
        packed_row = dict(zip(order, rows.tolist()))
        sampled = [packed_row[i] for i, c in enumerate(chunks) if c.sampled]
        self.np64[n64:n64 + len(sampled)] = sampled
        n32, context_lens = self._pack_sequences([chunks[i] for i in order])
        spans = self._pack_tables([chunks[i].block_table for i in order])
        self._copy_to_device(n64 + len(sampled), n32, spans)
        t, s = num_tokens, num_seqs
        meta = AttentionMetadata(
            slot_mapping=self.device64[2 * t:3 * t], block_tables=self.device_tables[:s],
            context_lens=self.device32[:s], query_start=self.device32[s:2 * s + 1],
            max_query_len=max(len(c.token_ids) for c in chunks),
            max_context_len=max(context_lens) if max_context_len is None else max_context_len,
            sliding_window=self.sliding_window, num_decodes=len(decodes))
        return StepInputs(self.device64[:t], self.device64[t:2 * t], meta, self.device64[n64:n64 + len(sampled)])

    def _pack_tokens(self, chunks: list[Chunk], num_tokens: int) -> int:
        """Token ids, positions and slots, ``[3, num_tokens]`` at the front of the int64 buffer; returns its length."""
        block_size = self.block_size
        tokens = self.np64[:num_tokens]
        positions = self.np64[num_tokens:2 * num_tokens]
        slots = self.np64[2 * num_tokens:3 * num_tokens]
        row = 0
        for chunk in chunks:
            n, start = len(chunk.token_ids), chunk.start
            if not chunk.block_table:
                tokens[row], positions[row], slots[row] = chunk.token_ids[0], start, -1
            elif n == 1:
                tokens[row], positions[row] = chunk.token_ids[0], start
                slots[row] = chunk.block_table[start // block_size] * block_size + start % block_size
            else:
                tokens[row:row + n] = chunk.token_ids
                pos = np.arange(start, start + n)
                positions[row:row + n] = pos
                slots[row:row + n] = np.asarray(chunk.block_table)[pos // block_size] * block_size + pos % block_size
            row += n
        return 3 * num_tokens

    def _pack_sequences(self, chunks: list[Chunk]) -> tuple[int, list[int]]:
        """Context lengths and query starts in the int32 buffer; returns its length."""
        s = len(chunks)
        context_lens = [c.start + len(c.token_ids) for c in chunks]
        self.np32[:s] = context_lens
        self.np32[s] = 0
        self.np32[s + 1:2 * s + 1] = np.cumsum([len(c.token_ids) for c in chunks])
        return 2 * s + 1, context_lens

    def _pack_tables(self, tables: list[list[int]]) -> list[tuple[int, int]]:
        """Write each row's changed columns; returns the changed ``(start, end)`` spans of the flat table buffer,
        those closer than ``MERGE_GAP`` merged."""
        w, spans = self.width, []
        for row, table in enumerate(tables):
            n, held = len(table), self.table_lens[row]
            if n > w:
                raise ValueError(f"a sequence holds {n} blocks, more than the {w} a block table has room for; "
                                 f"raise max_model_len")
            line = self.np_tables[row]
            differs = np.flatnonzero(line[:n] != np.asarray(table, dtype=np.int32))
            lo, hi = (int(differs[0]), int(differs[-1]) + 1) if differs.size else (n, n)
            line[lo:hi] = table[lo:hi]
            if held > n:  # a shorter table than the row held: zero what it left behind
                line[n:held] = 0
                lo, hi = min(lo, n), held
            self.table_lens[row] = n
            if lo < hi:
                start, end = row * w + lo, row * w + hi
                if spans and start - spans[-1][1] < MERGE_GAP:
                    spans[-1] = (spans[-1][0], end)
                else:
                    spans.append((start, end))
        return spans

    def _copy_to_device(self, n64: int, n32: int, table_spans: list[tuple[int, int]]) -> None:
        if self.device64 is self.host64:
            return
        host, device = self.host_tables.view(-1), self.device_tables.view(-1)
        with self.streams.compute:
            self.device64[:n64].copy_(self.host64[:n64], non_blocking=True)
            self.device32[:n32].copy_(self.host32[:n32], non_blocking=True)
            if table_spans:
                torch._foreach_copy_([device[a:b] for a, b in table_spans], [host[a:b] for a, b in table_spans],
                                     non_blocking=True)
        self.copied = self.streams.compute.record()
