"""Triton kernels: paged decode and prefill attention, storing K/V, copying cache blocks within and across pools.

Triton is imported only when a kernel is first looked up, so ``import kvlib.kernels`` works where
Triton is not installed (macOS, Windows) and the failure, a clear ImportError, comes only when a
kernel is actually used. ``triton_available`` lets callers choose a backend without trying;
``for_device`` gives the launchers that can run on a device's tensors.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

import torch

_EXPORTS = {
    "paged_decode_attention": "kvlib.kernels.paged_decode",
    "choose_num_splits": "kvlib.kernels.paged_decode",
    "split_warm_up_bounds": "kvlib.kernels.paged_decode",
    "paged_prefill_attention": "kvlib.kernels.paged_prefill",
    "store_kv": "kvlib.kernels.cache_ops",
    "copy_blocks": "kvlib.kernels.cache_ops",
    "copy_blocks_across": "kvlib.kernels.cache_ops",
}

__all__ = [*_EXPORTS, "triton_available", "for_device"]


def triton_available() -> bool:
    """Whether Triton can be imported here (it may still lack a GPU: see TRITON_INTERPRET)."""
    return importlib.util.find_spec("triton") is not None


def for_device(device: torch.device):
    """The kernel launchers for tensors on ``device``: this module's, or, for CPU tensors where Triton compiles
    (a machine with a GPU), interpreted copies (``kvlib.kernels.interpreted``)."""
    if device.type == "cpu" and not importlib.import_module("kvlib.kernels.attention_tiles").INTERPRETED:
        from kvlib.kernels.interpreted import interpreted_kernels
        return interpreted_kernels()
    return sys.modules[__name__]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not triton_available():
        raise ImportError(f"kvlib.kernels.{name} needs Triton, which is not installed (it ships for Linux only); "
                          "use attention_backend='torch' instead")
    return getattr(importlib.import_module(module), name)
