"""Turn each sequence's next-token logits into a token: greedy, or seeded temperature / top-p.

All rows are sampled together on the logits' device and read back once. A drawn row picks the
token maximizing ``p / q``, where ``q`` holds one Exp(1) number per token drawn from the row's own
random stream (the exponential race: it picks each token with probability ``p``, and it is how
``torch.multinomial`` draws one sample, so on a CPU a seeded request gets exactly the tokens it got
when each row called ``torch.multinomial``). A row's token depends on its own logits and stream
only, never on the rest of the batch. On a GPU each sequence's stream is a generator on the GPU,
seeded like the sequence's own, so the noise never crosses the host link.
"""
from __future__ import annotations

import weakref

import torch

from kvlib.core.sequence import Sequence


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row of ``probs`` cut to the smallest set of tokens whose probability reaches its ``top_p`` (always
    at least one), in vocabulary order; rows with ``top_p >= 1`` are left exactly as they are."""
    ranked, order = probs.sort(dim=-1, descending=True)
    before = ranked.cumsum(-1) - ranked
    limit = top_p.masked_fill(top_p >= 1.0, float("inf"))[:, None]
    cut = before >= limit
    cut[:, 0] = False  # the top token stays even when top_p is so small that it is 0 in float32
    return torch.zeros_like(probs).scatter_(-1, order, ranked.masked_fill_(cut, 0.0))


def tempered(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits / temperature`` per row, in float32; a row whose quotient would overflow (a temperature near the
    smallest float32) is shifted by its maximum first, so its top token gets 0 rather than inf, and inf - inf
    never makes the softmax NaN. Other rows are divided as they are, so their draws keep every bit."""
    logits, temperature = logits.float(), temperature[:, None]
    scaled = logits / temperature
    overflows = ~scaled.isfinite().all(dim=-1, keepdim=True)  # decided on the device: no sync
    shifted = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    return torch.where(overflows, shifted, scaled)


def race(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor,
         cut: bool) -> torch.Tensor:
    """Each token's standing in its row's race, ``probs / noise``, ``noise`` being Exp(1) ``[rows, vocab]``
    (``cut``: some row has ``top_p < 1``): the largest wins."""
    probs = tempered(logits, temperature).softmax(dim=-1)
    if cut:
        probs = top_p_filter(probs, top_p)
    return probs / noise


def draw(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor,
         cut: bool) -> torch.Tensor:
    """One token per row of ``logits`` ``[rows, vocab]``: the winner of its race."""
    return race(logits, temperature, top_p, noise, cut).argmax(dim=-1)


class Sampler:
    """Samples a step's rows; per-row settings reach the device in one copy from a persistent buffer."""

    def __init__(self, max_rows: int, device: torch.device):
        self.device = device
        pinned = device.type == "cuda"
        self.host = torch.zeros(max_rows, 3, pin_memory=pinned)  # per row: drawn (0 or 1), temperature, top_p
        self.on_device = self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        self.generators: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sequence -> its GPU stream

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of ``logits`` ``[len(seqs), vocab]``."""
        tokens = logits.argmax(dim=-1)
        if all(seq.params.greedy for seq in seqs):
            return tokens.tolist()
        count = len(seqs)
        self.host[:count] = torch.tensor([(0.0, 1.0, 1.0) if seq.params.greedy else
                                          (1.0, seq.params.temperature, seq.params.top_p) for seq in seqs])
        if self.on_device is not self.host:  # the previous call's read-back waited for its copy
            self.on_device[:count].copy_(self.host[:count], non_blocking=True)
        drawn, temperature, top_p = self.on_device[:count].T
        noise = torch.ones_like(logits, dtype=torch.float32)
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                noise[row].exponential_(1, generator=self._stream(seq))
        cut = any(seq.params.top_p < 1.0 for seq in seqs if not seq.params.greedy)
        tokens = torch.where(drawn > 0, draw(logits, temperature, top_p, noise, cut), tokens)
        return tokens.tolist()

    def _stream(self, seq: Sequence) -> torch.Generator:
        """The sequence's own generator on a CPU; on a GPU, one on the GPU with the same seed, kept while the
        sequence lives."""
        if self.device.type == "cpu":
            return seq.generator
        if seq not in self.generators:
            self.generators[seq] = torch.Generator(self.device).manual_seed(seq.generator.initial_seed())
        return self.generators[seq]
