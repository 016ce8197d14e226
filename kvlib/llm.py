"""``LLM``: the one-call front door, ``generate`` a list of prompts to completion."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

from kvlib.config import EngineConfig, SamplingParams
from kvlib.engine import LLMEngine
from kvlib.metrics import EngineMetrics
from kvlib.outputs import RequestOutput

Prompt = Union[str, list[int]]


class LLM:
    """Serve prompts on a paged KV cache.

    Pluggable pieces replace the engine's own, so your code runs inside the real engine:
    ``allocator`` (a class or factory called with a pool's block count, see ``block_allocator.py``),
    ``preemption_policy`` (``preemption.py``), ``attention_backend`` (``attention/``),
    ``block_sharing`` (``sharing.py``) and ``oversubscription_detector`` (``oversubscription.py``).
    """

    def __init__(self, model: Union[str, Path] = "default", config: Optional[EngineConfig] = None, *,
                 allocator=None, preemption_policy=None, attention_backend=None, block_sharing=None,
                 oversubscription_detector=None, verbose: bool = True):
        self.engine = LLMEngine(model, config, allocator=allocator, preemption_policy=preemption_policy,
                                attention_backend=attention_backend, block_sharing=block_sharing,
                                oversubscription_detector=oversubscription_detector, verbose=verbose)

    @property
    def metrics(self) -> EngineMetrics:
        return self.engine.metrics

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order, rejected ones included."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams; give one, or one per prompt")
        base = self.metrics.num_finished + self.metrics.num_rejected
        ids = [f"req-{base + i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, per_prompt):
            self.engine.add_request(request_id, prompt, p)
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(prompts)) if progress else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[i] for i in ids]


def _progress_bar(total: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="requests", unit="req")
