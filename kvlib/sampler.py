"""Turn each sequence's next-token logits into a token: greedy, or seeded temperature / top-p.

All rows are sampled together on the logits' device and read back once. Each drawn row takes one
uniform number from its own sequence's random stream and picks its token by inverse transform
sampling (the first token whose cumulative probability passes it), so a seeded sample does not
depend on what else is in the batch.
"""
from __future__ import annotations

import torch

from kvlib.sequence import Sequence


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row cut to the tokens at least as likely as the least likely one of the smallest set reaching its
    ``top_p`` (always one token); rows stay in vocabulary order."""
    ranked = probs.sort(dim=-1, descending=True).values
    before = ranked.cumsum(-1) - ranked
    cutoff = ranked.masked_fill(before >= top_p[:, None], float("inf")).amin(dim=-1, keepdim=True)
    cutoff.masked_fill_(top_p[:, None] >= 1.0, 0.0)  # uncut rows stay exactly as they are, rounding aside
    return probs.masked_fill(probs < cutoff, 0.0)


def draw(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor,
         cut: bool) -> torch.Tensor:
    """One token per row of ``logits`` ``[rows, vocab]`` (``cut``: some row has ``top_p < 1``).

    The cumulative sum runs in vocabulary order for every row, cut or not, so a row's token depends on
    its own logits and uniform number only.
    """
    probs = (logits.float() / temperature[:, None]).softmax(dim=-1)
    if cut:
        probs = top_p_filter(probs, top_p)
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=probs.shape[1] - 1)
    return picked[:, 0]


class Sampler:
    """Samples a step's rows; the per-row settings reach the device in one copy from a persistent buffer."""

    def __init__(self, max_rows: int, device: torch.device):
        pinned = device.type == "cuda"
        self.host = torch.zeros(max_rows, 4, pin_memory=pinned)  # per row: drawn (0 or 1), temperature, top_p, uniform
        self.on_device = self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of ``logits`` ``[len(seqs), vocab]``."""
        tokens = logits.argmax(dim=-1)
        if all(seq.params.greedy for seq in seqs):
            return tokens.tolist()
        count = len(seqs)
        self.host[:count] = torch.tensor([
            (0.0, 1.0, 1.0, 0.0) if seq.params.greedy else
            (1.0, seq.params.temperature, seq.params.top_p, float(torch.rand((), generator=seq.generator)))
            for seq in seqs])  # free: the previous call's read-back waited for its copy
        if self.on_device is not self.host:
            self.on_device[:count].copy_(self.host[:count], non_blocking=True)
        drawn, temperature, top_p, uniform = self.on_device[:count].T
        cut = any(seq.params.top_p < 1.0 for seq in seqs if not seq.params.greedy)
        tokens = torch.where(drawn > 0, draw(logits, temperature, top_p, uniform, cut), tokens)
        return tokens.tolist()
