"""How much one request may ask for: ``kvlib serve``'s request limits, without any server library.

The engine serves requests first come, first served: a request of 20,000 prompts would put them all
ahead of every request that comes after it, and a body of megabytes is parsed and tokenized before
anything can refuse it. Each limit refuses such a request at once, with a message naming the flag.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlib.config import is_integer

LIMIT_FLAGS = {"max_prompts": "--max-prompts-per-request", "max_prompt_tokens": "--max-prompt-tokens-per-request",
               "max_body_bytes": "--max-body-bytes"}


@dataclass(frozen=True)
class RequestLimits:
    """The defaults leave room for any one prompt of a long-context model and for batch clients, and refuse
    what no interactive server should queue at once. A body is parsed holding the GIL (JSON, then its
    fields: about 0.1 s per MB of token ids on one CPU core), so its limit bounds how long that stalls
    the event loop too; the default admits what the token limit admits, and no more."""

    max_prompts: int = 256  # prompts in one completions request (a list of prompts)
    max_prompt_tokens: int = 262_144  # prompt tokens in one request, all its prompts together
    max_body_bytes: int = 2 * 1024 * 1024  # the request body: 262,144 token ids take up to ~1.8 MB of JSON

    def __post_init__(self) -> None:
        for name, flag in LIMIT_FLAGS.items():
            value = getattr(self, name)
            if not (is_integer(value) and value >= 1):
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
