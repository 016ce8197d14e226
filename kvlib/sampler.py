"""Turn each sequence's next-token logits into a token: greedy, or seeded temperature / top-p."""
from __future__ import annotations

import torch

from kvlib.sequence import Sequence


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches ``top_p`` (always at least one)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs[before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of ``logits`` ``[len(seqs), vocab]``."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.greedy:
            continue
        probs = top_p_filter((logits[row].float() / params.temperature).softmax(-1), params.top_p)
        tokens[row] = int(torch.multinomial(probs.cpu(), 1, generator=seq.generator))
    return tokens
