"""transformers' baselines for ``kvlib bench engine``: its static batching and its paged continuous batching, each
within exactly the KV token slots kvlib gets."""
from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Optional

import torch

from kvlib.cli.bench.engine_workload import (Placement, Request, Served, placement_fields, require_fits,
                                             serve_as_they_arrive, served_row)


def load_transformers(folder: Path, placement: Placement):
    """The transformers model on ``placement``'s device in its dtype, with no end-of-sequence token (kvlib ignores
    it too, so both produce exactly the tokens asked for)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=placement.dtype)
    model = model.to(placement.device).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.generate(torch.tensor([[3]], device=placement.device), max_new_tokens=2, do_sample=False,
                       pad_token_id=0)  # warm-up
    return model


class StepTimer:
    """A ``generate`` streamer that notes when each step's new tokens arrive (its first call is the prompt)."""

    def __init__(self):
        self.calls, self.token_times = 0, []

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:
            self.token_times.append(time.perf_counter())

    def end(self) -> None:
        pass


def static_batch(queue: list[Request], now: float, slots: int, max_rows: int) -> list[Request]:
    """The arrived requests, in order, that one padded batch can hold within ``slots``: rows times (longest prompt
    plus longest output) never exceeds them."""
    batch, width, new = [], 0, 0
    for r in queue:
        if r.arrival > now or len(batch) == max_rows:
            break
        w, n = max(width, len(r.prompt)), max(new, r.max_tokens)
        if (len(batch) + 1) * (w + n) > slots:
            break
        batch, width, new = batch + [r], w, n
    return batch


class StaticBatches:
    """transformers ``generate`` on padded batches of at most ``max_rows`` rows within ``slots``, with its dynamic
    or static cache."""

    def __init__(self, model, slots: int, max_rows: int, cache: str, placement: Placement):
        self.model, self.slots, self.max_rows, self.cache, self.placement = model, slots, max_rows, cache, placement
        self.name = f"transformers generate (static batches of <= {max_rows}, {cache} cache)"

    def serve(self, requests: list[Request]) -> Served:
        device, pad = self.placement.device, 0
        require_fits(requests, self.slots)
        start, queue, arrivals, done, tokens, peak = time.perf_counter(), list(enumerate(requests)), {}, {}, {}, 0
        while queue:
            now = time.perf_counter() - start
            if queue[0][1].arrival > now:
                time.sleep(queue[0][1].arrival - now)
                now = queue[0][1].arrival
            batch = static_batch([r for _, r in queue], now, self.slots, self.max_rows)
            indices, queue = [i for i, _ in queue[:len(batch)]], queue[len(batch):]
            width, new = max(len(r.prompt) for r in batch), max(r.max_tokens for r in batch)
            peak = max(peak, len(batch) * (width + new))
            ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in batch], device=device)
            mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=device)
            timer = StepTimer()
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                          pad_token_id=pad, streamer=timer, cache_implementation=self.cache)
            end = time.perf_counter()
            for row, (i, r) in enumerate(zip(indices, batch)):
                arrivals[i] = [t - start for t in timer.token_times[:r.max_tokens]]
                done[i], tokens[i] = end - start, out[row, width:width + r.max_tokens].tolist()
        row = served_row(self.name, requests, (time.perf_counter() - start, arrivals, done, tokens), peak)
        row.update(placement_fields(self.placement), preemptions=0)
        return row


def has_paged_batching(model) -> bool:
    """Whether the installed transformers has paged continuous batching (``generate_batch``, transformers >= 4.56)."""
    return hasattr(model, "init_continuous_batching")


def transformers_version() -> str:
    import transformers
    return transformers.__version__


def paged_config(config_class, page_size: int, **options):
    """``config_class`` with pages of ``page_size`` tokens, under the name the installed transformers gives them:
    ``page_size`` in 5.25, ``block_size`` in 5.17 (read from its signature, not assumed from one release)."""
    parameters = inspect.signature(config_class).parameters
    name = next((name for name in ("page_size", "block_size") if name in parameters), None)
    if name is None:
        raise TypeError(f"transformers {transformers_version()}'s {config_class.__name__} takes neither page_size nor "
                        f"block_size, so its paged cache cannot be given kvlib's block size: install a transformers "
                        f"release whose ContinuousBatchingConfig takes one of them (5.17 and 5.25 do)")
    return config_class(**{name: page_size}, **options)


PAGED_CACHE_LAYOUTS = (  # how each known release's paged cache says how many token slots it holds
    lambda cache: sum(a.num_blocks * a.tokens_per_page for a in cache.cache_allocators.values()),  # 5.25
    lambda cache: cache.num_blocks * cache.block_size,  # 5.17
)


def paged_cache_slots(cache) -> Optional[int]:
    """The token slots transformers' paged cache really holds, read from whichever layout the installed release has;
    None when it has none of the known ones (the caller then reports the slots it asked for, saying so)."""
    for slots in PAGED_CACHE_LAYOUTS:
        try:
            return int(slots(cache))
        except AttributeError:
            continue
    return None


class PagedBatches:
    """transformers' own paged continuous batching (the manager behind ``generate_batch``): a paged cache of exactly
    ``slots`` token slots in blocks of ``block_size``, the requests handed over as they arrive."""

    def __init__(self, model, slots: int, block_size: int, max_batch_tokens: int, placement: Placement):
        self.model, self.slots, self.block_size, self.placement = model, slots, block_size, placement
        self.max_batch_tokens = max_batch_tokens
        self.name = "transformers paged continuous batching (generate_batch)"

    def _manager(self):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        config = paged_config(ContinuousBatchingConfig, self.block_size, num_blocks=self.slots // self.block_size,
                              max_batch_tokens=self.max_batch_tokens, max_requests_per_batch=256)
        generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
        return self.model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)

    def serve(self, requests: list[Request]) -> Served:
        require_fits(requests, self.slots)
        manager = self._manager()
        manager.start()
        try:
            in_flight = set()

            def submit(i, r, arrival):
                in_flight.add(i)
                manager.add_request(r.prompt, request_id=str(i), max_new_tokens=r.max_tokens, record_timestamps=True)

            def poll():
                result = manager.get_result(timeout=0.01)
                if result is None and not manager.is_running():
                    raise RuntimeError("transformers' paged batching stopped with requests unfinished (its log says why)")
                if result is None or not result.is_finished():
                    return []
                i = int(result.request_id)
                in_flight.discard(i)
                if result.error is not None:
                    raise RuntimeError(f"transformers' paged batching failed request {i}: {result.error}")
                if not result.timestamps:
                    raise RuntimeError(f"transformers {transformers_version()} recorded no token times for request "
                                       f"{i} although asked to (record_timestamps=True): its TTFT cannot be measured")
                return [(i, result.timestamps[-1], list(result.timestamps), list(result.generated_tokens))]
            served = serve_as_they_arrive(requests, submit, poll, lambda: bool(in_flight))
            read = paged_cache_slots(getattr(manager.batch_processor, "cache", None))
        finally:
            manager.stop(block=True, timeout=10)
            manager.destroy()
        row = served_row(self.name, requests, served, self.slots if read is None else read)
        row.update(placement_fields(self.placement), preemptions=None)
        if read is None:
            row["KV slots note"] = (f"requested, not read: transformers {transformers_version()}'s paged cache has "
                                    f"none of the layouts kvlib knows")
        return row
