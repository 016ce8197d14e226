"""What a request gives back: its tokens, its text, why it ended, and how long it took."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class SampleOutput:
    token_ids: list[int]
    text: Optional[str] = None
    finish_reason: Optional[str] = None  # "stop", "length", "rejected", or "aborted" (by a plugged-in piece)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    samples: list[SampleOutput]
    finished: bool
    error: Optional[str] = None  # why a rejected request could not run, and what to change

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def text(self) -> Optional[str]:
        return self.samples[0].text

    @property
    def finish_reason(self) -> Optional[str]:
        return self.samples[0].finish_reason

    @property
    def rejected(self) -> bool:
        return self.error is not None

    @property
    def aborted(self) -> bool:
        """A plugged-in piece aborted it during a step (the engine counts it in ``num_aborted``)."""
        return any(sample.finish_reason == "aborted" for sample in self.samples)
