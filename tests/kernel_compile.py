"""Compile every Triton kernel variant ahead of time for sm_75, sm_80, sm_89 and sm_90, no GPU needed, and report.

Run as a script with ``TRITON_INTERPRET=0`` (under the interpreter kernels are Python functions and
do not compile); it prints one JSON object per (variant, architecture). ``test_kernel_compile.py``
runs it and checks the reports.

Each variant is captured from the real launcher: the kernel is swapped for a recorder, the
launcher runs on CPU tensors shaped as the engine's (a 6-d pool, head dim 128, blocks of 16), and
the recorded arguments are compiled with the specialization a launch would get: integer
arguments equal to 1 become constants, multiples of 16 and the (16-byte aligned) pointers carry
a divisibility hint, except for the integers a kernel declares ``do_not_specialize``. Head dim 128 is the largest kvlib's architectures use; smaller head dims
compile to smaller tiles.

sm_75 (a T4) has no bfloat16: only the float16 and float32 variants are tried there, and a variant
that fails to compile is reported (``compiled`` false, with the error) rather than raised, since the
engine serves such a GPU with its torch backend and the report only documents what a T4 could run.
On the other architectures every variant must compile. For each compiled variant the report gives:

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

ARCHS = (75, 80, 89, 90)
BF16_MIN_ARCH = 80  # the first architecture with bfloat16 arithmetic
OPTIONAL_ARCHS = (75,)  # compile failures are reported, not raised: kvlib's kernels target 8.0+
TUNING_MARK = "tuning:"  # labels a variant only a sweep launches
TUNING_ARCHS = (90,)  # where the bench's sweeps run (an H100 or H200): the only target of their non-default tunings
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


def record_variants() -> list[tuple[str, object, tuple, dict]]:
    """Run every launcher once per variant with the kernels swapped for recorders: ``(label, kernel, args, kwargs)``.

    Every dtype gets the default launches; bfloat16, what the engine serves compute capability 8.0+ in, also
    gets the merge at the rule's widest, ``MAX_SPLITS``, and, labelled ``TUNING_MARK``, the tunings ``kvlib bench
    kernels``' sweeps try (``DECODE_TUNINGS``, ``PREFILL_TUNINGS``) and the merges of forced split counts past
    ``MAX_SPLITS``."""
    from kvlib import kernels
    from kvlib.cli.bench.kernels import (
        DECODE_TUNINGS,
        DEFAULT_DECODE_TUNING,
        PREFILL_TUNINGS,
        SWEEP_SPLITS,
    )
    from kvlib.kernels.attention_tiles import kernel_config
    from kvlib.kernels.paged_decode import MAX_SPLITS
    launches: list = []
    variants: list = []

    def capture(variant: str, launch, keep: slice = slice(None)) -> None:
        first = len(launches)
        launch()
        kept = launches[first:][keep]
        del launches[first:]
        launches.extend(kept)
        variants.extend(f"{name} ({variant})" for name, *_ in kept)

    with recording(launches):
        for dtype_name, dtype in DTYPES.items():
            pool = torch.zeros(64, 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)
            k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
            tables = torch.zeros(4, 256, dtype=torch.int32)
            context_lens = torch.full((4,), 200, dtype=torch.int32)
            decode_query = torch.zeros(4, KV_HEADS * GROUP, HEAD_DIM, dtype=dtype)
            prefill_query = torch.zeros(150, KV_HEADS * GROUP, HEAD_DIM, dtype=dtype)
            query_start = torch.tensor([0, 100, 101, 102, 150], dtype=torch.int32)
            key = torch.zeros(5, KV_HEADS, HEAD_DIM, dtype=dtype)

            def decode(splits: int, **tunables):
                return lambda: kernels.paged_decode_attention(decode_query, k_cache, v_cache, tables, context_lens,
                                                              0.1, max_context_len=4096, num_splits=splits,
                                                              **tunables)

            def prefill(**tunables):
                return lambda: kernels.paged_prefill_attention(prefill_query, k_cache, v_cache, tables, context_lens,
                                                               query_start, 100, 0.1, **tunables)

            for splits in (1, 3):
                capture(f"{dtype_name}, {splits} split(s)", decode(splits))
            capture(dtype_name, prefill())
            capture(dtype_name, lambda: kernels.store_kv(key, key, k_cache, v_cache, torch.zeros(5, dtype=torch.int64)))
            if dtype != torch.bfloat16:
                continue
            for tuning in DECODE_TUNINGS:
                if tuning != DEFAULT_DECODE_TUNING:
                    block_n, warps, stages = tuning
                    capture(f"{dtype_name}, split, {TUNING_MARK} BLOCK_N {block_n}, {warps} warps, {stages} stages",
                            decode(3, block_n=block_n, num_warps=warps, num_stages=stages), keep=slice(0, 1))
            # The merge's widest tiles: the rule's MAX_SPLITS, then the sweep's forced counts past it, read in chunks.
            capture(f"{dtype_name}, {MAX_SPLITS} splits", decode(MAX_SPLITS), keep=slice(1, 2))
            for splits in SWEEP_SPLITS[-2:]:
                capture(f"{dtype_name}, {TUNING_MARK} {splits} splits", decode(splits), keep=slice(1, 2))
            config = kernel_config(dtype)  # what the capture launched: the tiles of a GPU before Hopper
            for tuning in PREFILL_TUNINGS:
                if tuning != (config.prefill_block_m, config.prefill_block_n, config.prefill_num_warps, 3):
                    block_m, block_n, warps, stages = tuning
                    capture(f"{dtype_name}, {TUNING_MARK} BLOCK_M {block_m}, BLOCK_N {block_n}, {warps} warps, "
                            f"{stages} stages",
                            prefill(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages))
        capture("any dtype", lambda: kernels.copy_blocks(pool, [0, 1], [2, 3]))
        host_pool = torch.zeros_like(pool)  # pinned host memory on a GPU: a pointer like any other
        ids = torch.tensor([0, 1])
        capture("any dtype", lambda: kernels.copy_blocks_across(pool, host_pool, ids, ids))
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


def compile_report(kernel, signature: dict, constants: dict, attrs: dict, options: dict, arch: int) -> dict:
    """What one compile for ``sm_{arch}`` gives (see the module doc)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", arch, 32),
                              options=options)
    return {"compiled": True, **ptxas_report(compiled.asm["ptx"], arch), "shared": compiled.metadata.shared,
            "num_warps": compiled.metadata.num_warps, **pipeline_report(compiled.asm["ttgir"], constants)}


def compile_all() -> list[dict]:
    reports = []
    for label, kernel, args, kwargs in record_variants():
        signature, constants, attrs, options = specialize(kernel, args, kwargs)
        uses_bf16 = "*bf16" in signature.values()
        for arch in ARCHS:
            if (uses_bf16 and arch < BF16_MIN_ARCH) or (TUNING_MARK in label and arch not in TUNING_ARCHS):
                continue
            try:
                report = compile_report(kernel, signature, constants, attrs, options, arch)
            except Exception as error:  # noqa: BLE001 - only where a failure is a finding, not a defect
                if arch not in OPTIONAL_ARCHS:
                    raise
                report = {"compiled": False, "error": f"{type(error).__name__}: {str(error)[:300]}"}
            reports.append({"variant": label, "arch": f"sm_{arch}", **report})
    return reports


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "0":
        raise SystemExit("run with TRITON_INTERPRET=0: interpreted kernels do not compile")
    for report in compile_all():
        print(json.dumps(report))
