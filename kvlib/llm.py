"""``LLM``: the one-call front door, ``generate`` a list of prompts to completion."""
from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Optional, Sequence, Union

from kvlib.config import EngineConfig, SamplingParams, is_integer
from kvlib.engine import LLMEngine
from kvlib.metrics import EngineMetrics
from kvlib.outputs import RequestOutput

Prompt = Union[str, list[int]]


class LLM:
    """Serve prompts on a paged KV cache.

    Pluggable pieces, passed as keyword arguments, replace the engine's own, so your code runs inside
    the real engine (the fields of :class:`kvlib.core.pieces.Pieces`); each one's contract is a protocol
    in ``kvlib/interfaces.py``: ``allocator`` (a class or factory called with a pool's block count),
    ``preemption_policy``, ``attention_backend``, ``block_sharing``, ``oversubscription_detector``,
    and, as classes built with the engine's own arguments, ``scheduler`` (a ``Scheduler`` subclass
    with its own scheduling step), ``block_manager`` (a ``BlockManager`` subclass with its own
    preemption mechanisms) and ``host_prefix_tier`` (called with the host pool's allocator).
    """

    def __init__(self, model: Union[str, Path] = "default", config: Optional[EngineConfig] = None, *,
                 verbose: bool = True, **pieces):
        self.engine = LLMEngine(model, config, verbose=verbose, **pieces)
        self._ids = itertools.count()
        self._generating = threading.Lock()  # held by the one generate() running

    @property
    def metrics(self) -> EngineMetrics:
        return self.engine.metrics

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order, rejected ones included.

        ``prompts`` is one prompt (a string, or a list or tuple of token ids) or a list of prompts. One that a
        plugged-in piece aborts comes back with the tokens it had, its finish reason ``"aborted"``.

        Requests added with ``engine.add_request`` keep their place: their outputs from the steps
        this call runs come back from the next ``engine.step()``. Should anything raise, this call's
        own requests are aborted, so the ``LLM`` stays usable. One call at a time: a call from a second
        thread while one runs raises ``RuntimeError`` at once (the engine is not thread-safe).
        """
        if not self._generating.acquire(blocking=False):
            raise RuntimeError("LLM.generate() is already running in another thread, and one engine steps for one "
                               "caller at a time: pass all the prompts to one call (they are batched together), "
                               "build one LLM per thread, or serve this one with kvlib serve, whose one loop takes "
                               "requests from any number of clients")
        try:
            return self._generate(prompts, params, progress)
        finally:
            self._generating.release()

    def _generate(self, prompts, params, progress: bool) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        per_prompt = _as_params_list(params, len(prompts))
        ids = [self._new_id() for _ in prompts]
        own = set(ids)
        finished: dict[str, RequestOutput] = {}
        others: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(prompts)) if progress else None
        try:
            for request_id, prompt, p in zip(ids, prompts, per_prompt):
                self.engine.add_request(request_id, prompt, p)
            while len(finished) < len(ids):
                for out in self.engine.step():
                    if out.request_id not in own:
                        others[out.request_id] = out
                    elif out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            self.engine.hand_back(list(others.values()))
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]

    def chat(self, conversations, params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             progress: bool = False) -> list[RequestOutput]:
        """``generate`` for an instruct model: each conversation (a string is one user message, or a list of
        ``{"role": ..., "content": ...}`` messages) goes through the model's chat template first."""
        if isinstance(conversations, str) or (isinstance(conversations, list) and conversations
                                              and isinstance(conversations[0], dict)):
            conversations = [conversations]
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer, so it has no chat template; use generate() "
                             "with token ids")
        prompts = [self.tokenizer.encode_chat([{"role": "user", "content": c}] if isinstance(c, str) else c)
                   for c in conversations]
        return self.generate(prompts, params, progress)

    def _new_id(self) -> str:
        while True:
            request_id = f"generate-{next(self._ids)}"
            if not self.engine.has_request(request_id):
                return request_id


def _as_prompt_list(prompts) -> list:
    """One prompt (a string, or a list or tuple of token ids) or a list or tuple of prompts, as a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_integer(prompts[0])):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        hint = " (for a numpy array or tensor of token ids, pass .tolist())" if hasattr(prompts, "tolist") else ""
        raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got "
                        f"{type(prompts).__name__}{hint}")
    return list(prompts)


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError(f"params must be a SamplingParams or a list of them, one per prompt; got {params!r}")
    if len(params) != count:
        raise ValueError(f"{count} prompts but {len(params)} SamplingParams; give one, or one per prompt")
    return list(params)


def _progress_bar(total: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="requests", unit="req")
