"""kvlib's kernels for CPU tensors on a machine where Triton compiles for a GPU: an interpreted second copy.

Triton decides once, when it is imported, whether ``@triton.jit`` compiles kernels or interprets
them (``TRITON_INTERPRET``), for its own library functions as much as for kvlib's kernels. With a
GPU present kvlib leaves it compiling, and a compiled kernel cannot read CPU tensors; so an engine
on ``device="cpu"`` with the Triton backend gets kernels from a second import of the kernel modules,
made with the interpreter on and with fresh copies of Triton's Python modules (its compiled core is
shared). The process's own Triton and kernels are put back untouched, so a GPU engine in the same
process keeps its compiled kernels.
"""
from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

KERNEL_MODULES = ("kvlib.kernels.attention_tiles", "kvlib.kernels.cache_ops", "kvlib.kernels.paged_decode",
                  "kvlib.kernels.paged_prefill")
_twins: SimpleNamespace | None = None


def _is_triton_python(name: str) -> bool:
    return (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")


def _import_interpreted() -> SimpleNamespace:
    saved = {name: module for name, module in sys.modules.items() if _is_triton_python(name) or name in KERNEL_MODULES}
    setting = os.environ.get("TRITON_INTERPRET")
    for name in saved:
        del sys.modules[name]
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        decode, prefill, cache_ops = (importlib.import_module(f"kvlib.kernels.{name}")
                                      for name in ("paged_decode", "paged_prefill", "cache_ops"))
    finally:
        for name in [n for n in sys.modules if _is_triton_python(n) or n in KERNEL_MODULES]:
            del sys.modules[name]
        sys.modules.update(saved)
        if setting is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = setting
    return SimpleNamespace(paged_decode_attention=decode.paged_decode_attention,
                           choose_num_splits=decode.choose_num_splits,
                           paged_prefill_attention=prefill.paged_prefill_attention,
                           store_kv=cache_ops.store_kv, copy_blocks=cache_ops.copy_blocks,
                           copy_blocks_across=cache_ops.copy_blocks_across)


def interpreted_kernels() -> SimpleNamespace:
    """The kernel launchers of ``kvlib.kernels``, running under the interpreter (imported once)."""
    global _twins
    if _twins is None:
        _twins = _import_interpreted()
    return _twins
