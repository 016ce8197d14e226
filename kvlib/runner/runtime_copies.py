"""Byte copies issued straight to the CUDA runtime: one ``cudaMemcpyAsync`` per run of blocks, about a
microsecond of the host's time each.

A swap through the staging buffer crosses the link as one copy per run of consecutive host blocks, and
with scattered host blocks that is one copy per block. Issued through torch, each copy is a ``copy_`` call
(dispatch, checks, the stream looked up, events kept for the pinned memory), host time of the same order
as a 512 KiB block's 10 us on a 55 GB/s link: on an H200 (2026-12-04) the staged path moved scattered
512 KiB blocks at 57-60% of one contiguous copy, and 2 MiB blocks at 76-81%. Called through ``ctypes``,
the runtime's own ``cudaMemcpyAsync`` queues the copies faster than the link drains them.

``StagedTransfer(copies="runtime")`` uses it; torch's copies stay the default until a GPU run weighs the
two (``kvlib bench swap`` times both paths, checking the bytes each moved). On a CPU, :func:`host_memcpy`
stands in for the runtime, so the tests check the very addresses and sizes a GPU would be asked to copy.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Callable, Optional, Sequence

import torch

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the runtime reads each copy's direction from its addresses
Memcpy = Callable[[int, int, int, int], int]  # (destination, source, bytes, stream handle) -> CUDA error code


def spans(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
    """``(destination address, source address, bytes)`` of each pair of views, which must match and be
    contiguous: a view with gaps is not one run of bytes."""
    if len(dsts) != len(srcs):
        raise ValueError(f"{len(dsts)} destinations for {len(srcs)} sources")
    copies = []
    for dst, src in zip(dsts, srcs):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"cannot copy {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}")
        if not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("a runtime copy moves one run of bytes: both views must be contiguous")
        copies.append((dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()))
    return copies


def issue(memcpy: Memcpy, copies: list[tuple[int, int, int]], stream: int) -> None:
    """Each copy on ``stream``, in order; a refused one raises with the runtime's error code."""
    for dst, src, nbytes in copies:
        code = memcpy(dst, src, nbytes, stream)
        if code != 0:
            raise RuntimeError(f"cudaMemcpyAsync of {nbytes} bytes failed with CUDA error {code}")


def host_memcpy(dst: int, src: int, nbytes: int, stream: int) -> int:
    """The CPU's stand-in for the runtime's copy: the bytes move now, and nothing is refused."""
    ctypes.memmove(dst, src, nbytes)
    return 0


def runtime_memcpy() -> Optional[Memcpy]:
    """``cudaMemcpyAsync`` of the CUDA runtime torch loaded (else the one the system names), or None where there
    is none to call."""
    path = _loaded("libcudart.so") or ctypes.util.find_library("cudart")
    if path is None:
        return None
    try:
        copy = ctypes.CDLL(path).cudaMemcpyAsync
    except (OSError, AttributeError):
        return None
    copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    copy.restype = ctypes.c_int
    return lambda dst, src, nbytes, stream: copy(dst, src, nbytes, CUDA_MEMCPY_DEFAULT, stream)


def _loaded(name: str) -> Optional[str]:
    """The path of a shared library this process has loaded whose file name contains ``name`` (Linux)."""
    if not os.path.exists("/proc/self/maps"):
        return None
    with open("/proc/self/maps") as maps:
        return next((line.split()[-1] for line in maps if name in line.rsplit("/", 1)[-1]), None)
