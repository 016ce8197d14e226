"""``kvlib serve MODEL``'s options: where to listen, and the engine's knobs as ``kvlib demo`` takes them.

This module imports no server library, so ``kvlib --help`` works without the ``serve`` extra; only
running the server needs it, and says how to install it when it is missing.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from kvlib.config import ATTENTION_BACKENDS, DEVICES, DTYPES, PREEMPTION_MODES, WEIGHT_FORMATS, EngineConfig
from kvlib.serve.limits import LIMIT_FLAGS, RequestLimits

ABOUT = """\
Serves MODEL over HTTP with OpenAI's API: POST /v1/completions and /v1/chat/completions (stream=true
for server-sent events), GET /v1/models, /health, and /metrics in Prometheus' text format with vLLM's
metric names (running, waiting and swapped requests, KV usage, preemptions, TTFT and inter-token
histograms). Any OpenAI client connects with base_url http://HOST:PORT/v1 and any api_key. To let
other machines connect (a workshop room), listen on --host 0.0.0.0."""
ENGINE_FLAGS = {  # EngineConfig field: its --help text
    "block_size": "tokens per KV block",
    "num_gpu_blocks": "KV blocks on the device (default: sized from free device memory); small, to watch preemption",
    "num_cpu_blocks": "KV blocks in host memory, where swapped-out blocks wait",
    "preemption_mode": "how a preempted request gives back its blocks: recompute them later, swap them to host "
                       "memory, or auto (the cost model chooses)",
    "partial_preemption": "preempt only the blocks needed, not whole requests",
    "enable_prefix_caching": "keep full prompt blocks named by their tokens, so a shared prefix is computed once",
    "host_prefix_cache": "cached prefix blocks evicted from the device wait in the host pool (needs "
                         "--enable-prefix-caching and --num-cpu-blocks)",
    "max_num_seqs": "sequences in the running batch at most (a request with n samples takes n)",
    "max_num_batched_tokens": "tokens computed in one step at most",
    "watermark": "fraction of the device pool kept free when admitting new requests",
    "device": "where the model runs",
    "dtype": "the model's and the KV cache's dtype (auto: bfloat16 on recent GPUs, float32 on a CPU)",
    "attention_backend": "the attention implementation (auto: Triton on a recent GPU, else torch)",
    "gpu_memory_utilization": "share of free device memory the KV pool takes when --num-gpu-blocks is not given",
    "max_model_len": "prompt plus output tokens at most (default: the model's max_position_embeddings)",
    "seed": "seeds the samples of requests that give no seed of their own",
    "metrics_history": "finished requests and steps the engine's metrics keep in memory",
    "weight_format": "on a CPU, the projections' weights: bfloat16, or q4_1 (a GGUF model's own 4-bit weights)",
}
CHOICES = {"preemption_mode": PREEMPTION_MODES, "device": DEVICES, "dtype": DTYPES,
           "attention_backend": ATTENTION_BACKENDS, "weight_format": WEIGHT_FORMATS}
OPTIONAL_INTS = ("num_gpu_blocks", "max_model_len", "metrics_history")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="default",
                        help="the model, as LLM takes it: default (the tiny built-in model), smollm2-135m, or a "
                             "Hugging Face model folder")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to listen on; 0.0.0.0 lets other machines on the network connect")
    parser.add_argument("--port", type=int, default=8000, help="the TCP port to listen on")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as model (default: MODEL, or a folder's own name)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                        help="how much uvicorn logs (info: one line per request)")
    limits = RequestLimits()
    parser.add_argument("--max-prompts-per-request", dest="max_prompts", type=int, default=limits.max_prompts,
                        help="prompts one completions request may hold; more get a 400")
    parser.add_argument("--max-prompt-tokens-per-request", dest="max_prompt_tokens", type=int,
                        default=limits.max_prompt_tokens,
                        help="prompt tokens one request may hold, all its prompts together; more get a 400")
    parser.add_argument("--max-body-bytes", dest="max_body_bytes", type=int, default=limits.max_body_bytes,
                        help="bytes a request body may hold; more get a 413")
    defaults = EngineConfig()
    for option in fields(EngineConfig):
        flag, default = f"--{option.name.replace('_', '-')}", getattr(defaults, option.name)
        if isinstance(default, bool):
            parser.add_argument(flag, dest=option.name, action=argparse.BooleanOptionalAction, default=default,
                                help=ENGINE_FLAGS.get(option.name))
        else:
            kind = int if option.name in OPTIONAL_INTS else type(default)
            parser.add_argument(flag, dest=option.name, type=kind, default=default,
                                choices=CHOICES.get(option.name), help=ENGINE_FLAGS.get(option.name))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{option.name: getattr(args, option.name) for option in fields(EngineConfig)})


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(**{name: getattr(args, name) for name in LIMIT_FLAGS})


def served_name(model: str) -> str:
    path = Path(model)
    return path.name if path.exists() else model


def run(args: argparse.Namespace) -> int:
    try:
        from kvlib.serve.app import build_app
        from kvlib.serve.server import run_server
    except ImportError as err:
        print(f"kvlib serve: {err.name} is not installed; the server needs kvlib's serve extra: in a clone "
              f'pip install -e ".[serve]", elsewhere pip install fastapi uvicorn prometheus-client httpx',
              file=sys.stderr)
        return 2
    from kvlib.llm import LLM
    try:
        config, limits = engine_config(args), request_limits(args)
    except ValueError as err:
        print(f"kvlib serve: {err}", file=sys.stderr)
        return 2
    try:
        llm = LLM(args.model, config)
    except (ValueError, OSError) as err:  # a model that is not there, settings this model cannot take
        print(f"kvlib serve: {err}", file=sys.stderr)
        return 2
    name = args.served_model_name or served_name(args.model)
    try:
        app = build_app(llm, name, limits)
    except ValueError as err:  # settings the server refuses to start with (a max_model_len beyond the KV pool)
        print(f"kvlib serve: {err}", file=sys.stderr)
        return 2
    print(f"kvlib serve: {name!r} on http://{args.host}:{args.port}/v1 (OpenAI API), metrics at /metrics; Ctrl-C stops")
    try:
        run_server(app, args.host, args.port, args.log_level)
    except KeyboardInterrupt:  # uvicorn raises Ctrl-C again once it has shut down: no traceback for it
        return 130
    return 0
