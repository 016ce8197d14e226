"""Pack one step's scheduled tokens into tensors, run the model, and return the logits to sample."""
from __future__ import annotations

import torch

from kvlib.attention.metadata import AttentionMetadata
from kvlib.sequence import Sequence


def build_step_inputs(scheduled: list[tuple[Sequence, int]], block_size: int, device: torch.device,
                      sliding_window: int | None = None):
    """Token ids, positions and attention metadata for packed sequences, plus the rows to sample.

    A sequence is sampled only when this step computes its last token: a chunk in the middle
    of a long prompt produces no token.
    """
    token_ids, positions, slots, context_lens, query_start, logits_rows = [], [], [], [], [0], []
    tables = []
    for seq, num_new in scheduled:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        blocks = seq.block_table.blocks
        token_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        tables.append(blocks)
        context_lens.append(end)
        query_start.append(query_start[-1] + num_new)
        if end == seq.num_tokens:
            logits_rows.append(query_start[-1] - 1)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        max_query_len=max(n for _, n in scheduled),
        max_context_len=max(context_lens),
        sliding_window=sliding_window,
    )
    return (torch.tensor(token_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device), meta,
            torch.tensor(logits_rows, dtype=torch.long, device=device))
