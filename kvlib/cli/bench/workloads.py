"""Synthetic request lengths that look like chat traffic, so memory benchmarks need no dataset download.

Real chat traffic (ShareGPT conversations are the usual stand-in) has short-to-medium prompts,
longer answers, and long tails on both. A log-normal distribution has exactly that shape.
"""
from __future__ import annotations

import math
import random

# Log-normal parameters (of the natural log of the length in tokens). They are chosen by hand to
# resemble published ShareGPT statistics (prompt mean roughly 160-200 tokens, output mean roughly
# 200-340 tokens, long tails); they are NOT fitted to the dataset itself.
PROMPT_MEDIAN, PROMPT_SIGMA = 110, 1.0  # mean before clipping: 110 * e^(1.0^2 / 2) ~ 181 tokens
OUTPUT_MEDIAN, OUTPUT_SIGMA = 220, 0.8  # mean before clipping: 220 * e^(0.8^2 / 2) ~ 303 tokens


def sharegpt_like_lengths(num_requests: int, seed: int = 0, max_len: int = 2048) -> list[tuple[int, int]]:
    """``num_requests`` (prompt_len, output_len) pairs, the same for the same seed.

    Clipping keeps every request servable in a context of ``max_len`` tokens: the prompt is at
    least 1 token and at most ``max_len // 2``; the output is at least 1 token and at most what
    the context has left, so ``prompt_len + output_len <= max_len``.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2 (one prompt and one output token), got {max_len}")
    rng = random.Random(seed)
    lengths = []
    for _ in range(num_requests):
        prompt = min(max(1, round(rng.lognormvariate(math.log(PROMPT_MEDIAN), PROMPT_SIGMA))), max_len // 2)
        output = min(max(1, round(rng.lognormvariate(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA))), max_len - prompt)
        lengths.append((prompt, output))
    return lengths
