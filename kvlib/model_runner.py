"""Pack one step's scheduled tokens into tensors, run the model, and return the logits to sample."""
from __future__ import annotations

import torch

from kvlib.attention.metadata import AttentionMetadata
from kvlib.sequence import Sequence


def build_step_inputs(scheduled: list[tuple[Sequence, int]], block_size: int, device: torch.device):
    """Token ids, positions and attention metadata for packed sequences, plus the rows to sample.

    A sequence is sampled only when this step computes its last token: a chunk in the middle
    of a long prompt produces no token.
    """
    token_ids, positions, slots, context_lens, query_start, logits_rows = [], [], [], [], [0], []
    max_blocks = max(len(seq.block_table) for seq, _ in scheduled)
    tables = torch.zeros((len(scheduled), max_blocks), dtype=torch.int32)
    for i, (seq, num_new) in enumerate(scheduled):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        token_ids.extend(seq.token_ids[start:end])
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table.blocks, dtype=torch.int64)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        tables[i, :len(table)] = table.to(torch.int32)
        context_lens.append(end)
        query_start.append(query_start[-1] + num_new)
        if end == seq.num_tokens:
            logits_rows.append(query_start[-1] - 1)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        block_tables=tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        max_query_len=max(n for _, n in scheduled),
        max_context_len=max(context_lens),
    )
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    return ids, torch.cat(positions).to(device), meta, torch.tensor(logits_rows, dtype=torch.long, device=device)
