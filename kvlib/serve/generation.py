"""One HTTP request as it runs: its engine requests, its choices' text, its stop strings, its abort.

Text is decoded incrementally, the way vLLM's detokenizer does it: each new token is decoded in a
window with the token before it, so a character split over several tokens is handed out once it is
whole. Stop strings are the server's: the engine stops on token ids, so when a choice's text
reaches a stop string the text is cut there and, once every choice of that prompt has stopped, the
engine loop ends the engine request (``EngineLoop.end_stopped``), freeing its blocks at once.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from functools import partial
from typing import AsyncIterator, Optional

from kvlib.outputs import RequestOutput
from kvlib.serve.engine_loop import EngineEvent, EngineLoop
from kvlib.serve.requests import EngineWork

INCOMPLETE = "\ufffd"  # what a tokenizer decodes half a UTF-8 character to


class ChoiceText:
    """One choice's tokens and text so far; ``take()`` hands out what may be sent now."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...]):
        self.tokenizer, self.stop_strings = tokenizer, stop_strings
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: Optional[str] = None
        self._sent = 0  # characters of text handed out
        self._sent_tokens = 0
        self._prefix_offset = self._read_offset = 0  # the decoding window, in token_ids
        self._hold = max((len(s) for s in stop_strings), default=1) - 1  # a stop string may be starting here

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_ids: list[int]) -> None:
        if self.finished or not token_ids:
            return
        self.token_ids += token_ids
        if self.tokenizer is None:
            return
        before = self.tokenizer.decode(self.token_ids[self._prefix_offset:self._read_offset])
        after = self.tokenizer.decode(self.token_ids[self._prefix_offset:])
        if len(after) > len(before) and not after.endswith(INCOMPLETE):
            self._extend(after[len(before):])
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)

    def finish(self, final_text: Optional[str], reason: Optional[str]) -> None:
        """The engine finished this sample: its text is the engine's own decode (``final_text``, or, for a sample that
        ended before the rest of its request, decoded here as the engine would), where it agrees with what was sent."""
        if self.finished:
            return
        if final_text is None and self.tokenizer is not None:
            final_text = self.tokenizer.decode(self.token_ids)
        if final_text is not None and final_text.startswith(self.text):
            self._extend(final_text[len(self.text):])
        if not self.finished:
            self.finish_reason = "abort" if reason == "aborted" else reason or "stop"  # "abort": vLLM's word

    def take(self) -> tuple[str, list[int]]:
        """The text and tokens not yet handed out; text that may be the start of a stop string waits."""
        end = len(self.text) if self.finished else max(self._sent, len(self.text) - self._hold)
        text, self._sent = self.text[self._sent:end], end
        tokens, self._sent_tokens = self.token_ids[self._sent_tokens:], len(self.token_ids)
        return text, tokens

    def _extend(self, new_text: str) -> None:
        start = max(0, len(self.text) - self._hold)
        self.text += new_text
        hits = [i for i in (self.text.find(s, start) for s in self.stop_strings) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.finish_reason = "stop"


class EngineFailure(Exception):
    def __init__(self, event: EngineEvent):
        super().__init__(event.error)
        self.status = event.status


class Generation:
    """The engine requests of one HTTP request (one per prompt), read from one queue, closed together."""

    def __init__(self, loop: EngineLoop, work: EngineWork, tokenizer, kind: str):
        self.id = f"{kind}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.work = work
        self.n = work.params.n
        self.choices = [ChoiceText(tokenizer, work.stop_strings) for _ in range(len(work.prompts) * self.n)]
        self.prompt_tokens = sum(len(p) for p in work.prompts)
        self._loop, self._aio = loop, asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._early: deque = deque()
        self._open = set(range(len(work.prompts)))  # engine requests still running
        for index, prompt in enumerate(work.prompts):
            loop.submit(self._request_id(index), prompt, work.params, partial(self._push, index))

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def _request_id(self, index: int) -> str:
        return f"{self.id}-{index}"

    def _push(self, index: int, event: EngineEvent) -> None:
        """On the engine thread: hand the event to this request's asyncio loop."""
        try:
            self._aio.call_soon_threadsafe(self._queue.put_nowait, (index, event))
        except RuntimeError:  # the HTTP side's loop is closed: nobody is left to tell
            pass

    async def wait_accepted(self) -> Optional[EngineEvent]:
        """None once the engine took every prompt, else the error event that refused one (the rest are aborted)."""
        accepted: set[int] = set()
        while len(accepted) < len(self.work.prompts):
            index, event = await self._queue.get()
            if event.kind in ("error", "closed"):
                self.close()
                return event
            if event.kind == "accepted":
                accepted.add(index)
            else:
                self._early.append((index, event))
        return None

    async def updates(self) -> AsyncIterator[list[int]]:
        """The choices each step changed, until every engine request is done; raises :class:`EngineFailure`."""
        while self._open:
            index, event = self._early.popleft() if self._early else await self._queue.get()
            if event.kind == "closed":
                return
            if event.kind == "error":
                self.close()
                raise EngineFailure(event)
            if event.kind == "output" and index in self._open:
                yield self._apply(index, event.output)

    def _apply(self, index: int, out: RequestOutput) -> list[int]:
        changed = []
        for j, sample in enumerate(out.samples):
            choice = self.choices[index * self.n + j]
            if choice.finished:
                continue
            choice.add(sample.token_ids[len(choice.token_ids):])
            if out.finished or sample.finish_reason is not None:  # a sample may end (EOS) before its request does
                choice.finish(sample.text, sample.finish_reason)
            changed.append(index * self.n + j)
        mine = self.choices[index * self.n:(index + 1) * self.n]
        if out.finished or all(c.finished for c in mine):
            self._open.discard(index)
            if not out.finished:  # every choice met a stop string: the engine need not go on
                self._loop.end_stopped(self._request_id(index))
        return changed

    def close(self) -> None:
        """Abort what still runs (a client gone, an error, a stop string) and wake whoever waits on the queue."""
        for index in sorted(self._open):
            self._loop.abort(self._request_id(index))
        self._open.clear()
        self._queue.put_nowait((None, EngineEvent("closed")))
