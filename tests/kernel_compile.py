"""Compile every Triton kernel variant ahead of time for sm_80 and sm_90, no GPU needed, and report on it.

Run as a script with ``TRITON_INTERPRET=0`` (under the interpreter kernels are Python functions and
do not compile); it prints one JSON object per (variant, architecture). ``test_kernel_compile.py``
runs it and checks the reports.

Each variant is captured from the real launcher: the kernel is swapped for a recorder, the
launcher runs on CPU tensors shaped as the engine's (a 6-d pool, head dim 128, blocks of 16), and
the recorded arguments are compiled with the specialization a launch would get: integer
arguments equal to 1 become constants, multiples of 16 and the (16-byte aligned) pointers carry
a divisibility hint, except for the integers a kernel declares ``do_not_specialize``. Head dim 128 is the largest kvlib's architectures use; smaller head dims
compile to smaller tiles. For each compiled variant the report gives:

- what ``ptxas -v`` says: registers, spill stores and spill loads; and from the compiled kernel's
  metadata its shared memory (``shared``, bytes) and ``num_warps``, what the split rule's occupancy
  (``paged_decode.programs_per_sm``) is taken from on a GPU;
- ``kv_buffers``: the depth of every shared-memory buffer shaped like one K or V tile
  (``ttg.local_alloc`` of ``N x BLOCK_N x HEAD_DIM_PAD``, read from the TTGIR): 1 means each tile's
  copy must land before the tile is computed, 2 or more that the pipeliner double-buffers it;
- ``max_wait_in_flight``: the largest ``num`` of the TTGIR's ``ttg.async_wait``, how many async
  copy groups may still be in flight when the loop waits; 0 means every wait drains all copies,
  so loads never overlap compute.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import tempfile

import torch

ARCHS = (80, 90)
HEAD_DIM = 128
KV_HEADS = 8
GROUP = 4
BLOCK_SIZE = 16
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
                torch.int64: "i64"}


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch instead of running it."""

    def __init__(self, kernel, name: str, launches: list):
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, self.kernel, args, kwargs))


@contextlib.contextmanager
def recording(launches: list):
    from kvlib.kernels import cache_ops, paged_decode, paged_prefill
    kernels = [(paged_decode, "_paged_decode_kernel"), (paged_decode, "_merge_splits_kernel"),
               (paged_prefill, "_paged_prefill_kernel"), (cache_ops, "_store_kv_kernel"),
               (cache_ops, "_copy_blocks_kernel")]
    saved = [(module, name, getattr(module, name)) for module, name in kernels]
    for module, name, kernel in saved:
        setattr(module, name, Recorder(kernel, name, launches))
    try:
        yield
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


@contextlib.contextmanager
def block_n(value: int):
    from kvlib.kernels import paged_decode
    saved, paged_decode.BLOCK_N = paged_decode.BLOCK_N, value
    try:
        yield
    finally:
        paged_decode.BLOCK_N = saved


def record_variants() -> list[tuple[str, object, tuple, dict]]:
    """Run every launcher once per variant with the kernels swapped for recorders: ``(label, kernel, args, kwargs)``."""
    from kvlib import kernels
    launches: list = []
    variants: list = []

    def capture(variant: str, launch) -> None:
        first = len(launches)
        launch()
        variants.extend(f"{name} ({variant})" for name, *_ in launches[first:])

    with recording(launches):
        for dtype_name, dtype in DTYPES.items():
            pool = torch.zeros(64, 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)
            k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
            tables = torch.zeros(4, 16, dtype=torch.int32)
            context_lens = torch.full((4,), 200, dtype=torch.int32)
            decode_query = torch.zeros(4, KV_HEADS * GROUP, HEAD_DIM, dtype=dtype)
            prefill_query = torch.zeros(150, KV_HEADS * GROUP, HEAD_DIM, dtype=dtype)
            query_start = torch.tensor([0, 100, 101, 102, 150], dtype=torch.int32)
            key = torch.zeros(5, KV_HEADS, HEAD_DIM, dtype=dtype)
            for splits in (1, 3):
                capture(f"{dtype_name}, {splits} split(s)", lambda: kernels.paged_decode_attention(
                    decode_query, k_cache, v_cache, tables, context_lens, 0.1, max_context_len=200, num_splits=splits))
            if dtype == torch.bfloat16:  # the tile the issue asked to try: 32 context tokens per loop step
                with block_n(32):
                    capture(f"{dtype_name}, 3 split(s), BLOCK_N 32", lambda: kernels.paged_decode_attention(
                        decode_query, k_cache, v_cache, tables, context_lens, 0.1, max_context_len=200, num_splits=3))
            capture(dtype_name, lambda: kernels.paged_prefill_attention(
                prefill_query, k_cache, v_cache, tables, context_lens, query_start, 100, 0.1))
            capture(dtype_name, lambda: kernels.store_kv(key, key, k_cache, v_cache, torch.zeros(5, dtype=torch.int64)))
        capture("any dtype", lambda: kernels.copy_blocks(pool, [0, 1], [2, 3]))
    return [(variant, kernel, args, kwargs) for variant, (_, kernel, args, kwargs) in zip(variants, launches)]


def specialize(kernel, args: tuple, kwargs: dict):
    """The signature, constants, attributes and options a launch with these arguments compiles with."""
    bound = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
    signature, constants, attrs = {}, {}, {}
    for index, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = bound[name]
        varying = param.do_not_specialize  # compiled for any value: no constant, no divisibility hint
        if param.is_constexpr or (isinstance(value, int) and not isinstance(value, bool) and value == 1 and not varying):
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and not varying:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} of type {type(value).__name__}")
    return signature, constants, attrs, options


def ptxas_report(ptx: str, arch: int) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        log = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}", source,
                              "-o", source + ".cubin"], capture_output=True, text=True, check=True).stderr
    number = lambda pattern: int(re.search(pattern, log).group(1))  # noqa: E731
    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads")}


def pipeline_report(ttgir: str, constants: dict) -> dict:
    if "BLOCK_N" not in constants:
        return {}
    tile = rf"{constants['BLOCK_N']}x{constants['HEAD_DIM_PAD']}x"
    buffers = [int(depth) for depth in re.findall(rf"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x{tile}",
                                                  ttgir)]
    waits = [int(num) for num in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+) : i32\}", ttgir)]
    return {"kv_buffers": buffers, "max_wait_in_flight": max(waits, default=0)}


def compile_all() -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    reports = []
    for label, kernel, args, kwargs in record_variants():
        signature, constants, attrs, options = specialize(kernel, args, kwargs)
        for arch in ARCHS:
            compiled = triton.compile(ASTSource(kernel, signature, constants, attrs),
                                      target=GPUTarget("cuda", arch, 32), options=options)
            reports.append({"variant": label, "arch": f"sm_{arch}", **ptxas_report(compiled.asm["ptx"], arch),
                            "shared": compiled.metadata.shared, "num_warps": compiled.metadata.num_warps,
                            **pipeline_report(compiled.asm["ttgir"], constants)})
    return reports


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "0":
        raise SystemExit("run with TRITON_INTERPRET=0: interpreted kernels do not compile")
    for report in compile_all():
        print(json.dumps(report))
