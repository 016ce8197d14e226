"""What the server tests share: a model folder with a chat template, a scrape of /metrics, the pools' check."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvlib.core.invariants import check_invariants
from kvlib.model.default import default_model_path

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")


def chat_model_folder(folder: Path) -> Path:
    """The built-in model with a chat template beside it: a model that serves chat, with nothing to download."""
    for path in default_model_path().iterdir():
        if path.is_file():
            shutil.copy(path, folder / path.name)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


def scrape(url: str) -> dict[str, float]:
    """Every sample of ``/metrics`` by name, summed over its labels (one model per server; finish reasons add up)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def successes(url: str, finished_reason: str) -> float:
    """``vllm:request_success_total`` for one finish reason."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total" and sample.labels["finished_reason"] == finished_reason:
                return sample.value
    return 0.0


def ended_requests(url: str, expected: int, timeout: float = 60.0) -> dict[str, float]:
    """``/metrics`` once ``expected`` requests have ended (finished or aborted): a client's close reaches the
    server a moment after the client returns. ``timeout`` only guards against a hang."""
    deadline = time.monotonic() + timeout
    while True:
        values = scrape(url)
        ended = values.get("kvlib:num_requests_aborted_total", 0) + values.get("vllm:request_success_total", 0)
        if ended >= expected or time.monotonic() > deadline:
            return values
        time.sleep(0.01)


def pools_state(llm) -> dict:
    """On the engine thread: the bookkeeping rules hold, and what is still held."""
    check_invariants(llm.engine)
    blocks = llm.engine.block_manager
    return {"unfinished": llm.engine.has_unfinished_requests(),
            "device_blocks_held": blocks.num_device_blocks - blocks.num_free_blocks,
            "host_blocks_held": llm.engine.config.num_cpu_blocks - blocks.num_free_host_blocks}


def settled_pools(server, timeout: float = 30.0) -> dict:
    """The pools once the loop has handled every abort sent so far (the inbox is first in, first out)."""
    return server.engine_loop.call(pools_state).result(timeout)


class FailingStep:
    """Wraps ``engine.step``: raises while ``failing`` is set, as a device error would."""

    def __init__(self, step):
        self.step, self.failing = step, False

    def __call__(self):
        if self.failing:
            raise RuntimeError("simulated device error")
        return self.step()
