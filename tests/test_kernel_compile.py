"""Every Triton kernel variant compiles for sm_80, sm_89 and sm_90 without register spills, and decode is pipelined;
what sm_75 (a T4, no bfloat16) makes of the float16 and float32 variants is stated, not required.

No GPU is needed: ``kernel_compile.py`` compiles ahead of time with Triton's CUDA backend and its
bundled ptxas, in a subprocess, because this process may run kernels under the interpreter. Its
docstring says what each report holds. Decode must double-buffer K and V in shared memory and
wait on its copies with some still in flight: that is the pipelining the block-id prefetch buys
(loading the ids in the same iteration gave one buffer each and waits that drain everything).
"""
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch


def ptxas_missing() -> str | None:
    """Why the ahead-of-time compile cannot run here, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        return "this Triton has no CUDA backend"
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        ptxas = get_ptxas(80).path
    except Exception as error:  # noqa: BLE001 - any failure to locate ptxas means: skip
        return f"Triton's CUDA backend finds no ptxas: {error}"
    return None if os.access(ptxas, os.X_OK) else f"ptxas at {ptxas} is not executable"


@pytest.fixture(scope="module")
def reports():
    reason = ptxas_missing()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    script = Path(__file__).with_name("kernel_compile.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


TARGETS = {"sm_80", "sm_89", "sm_90"}  # what kvlib's kernels target: compute capability 8.0+
KERNELS = {"_paged_decode_kernel", "_merge_splits_kernel", "_paged_prefill_kernel", "_store_kv_kernel",
           "_copy_blocks_kernel"}


def kernel_of(report: dict) -> str:
    return report["variant"].split(" ")[0]


def test_every_variant_compiled(reports):
    assert {kernel_of(r) for r in reports} == KERNELS
    assert {r["arch"] for r in reports} == TARGETS | {"sm_75"}
    assert all(r["compiled"] for r in reports if r["arch"] in TARGETS)


def test_no_register_spills(reports):
    spilled = [f"{r['variant']} on {r['arch']}: {r['spill_stores']} B stored, {r['spill_loads']} B loaded "
               f"({r['registers']} registers)" for r in reports
               if r["arch"] in TARGETS and (r["spill_stores"] or r["spill_loads"])]
    assert not spilled, "\n".join(spilled)


def test_decode_loads_overlap_compute(reports):
    """Every decode variant double-buffers K and V, except the 2-stage tuning the bench sweeps: with 2 stages the
    pipeliner keeps one buffer each and drains every copy, so that row measures decode without the overlap."""
    decode = [r for r in reports if kernel_of(r) == "_paged_decode_kernel" and r["arch"] in TARGETS]
    assert len(decode) == 25  # 3 dtypes x plain and split x 3 architectures, and 7 bfloat16 tunings on sm_90
    for r in decode:
        if "2 stages" in r["variant"]:
            assert r["kv_buffers"] == [1, 1] and r["max_wait_in_flight"] == 0, r
        else:
            assert len(r["kv_buffers"]) == 2 and min(r["kv_buffers"]) >= 2, r
            assert r["max_wait_in_flight"] >= 1, r


def test_what_a_t4_could_run(reports, capsys):
    """sm_75 has no bfloat16, so only float16 and float32 are tried there. Every one of those variants compiles,
    so a T4 could run the kernels in float16 or float32; kvlib's engine still serves compute capability below
    8.0 with its torch backend (``kvlib/runner/device.py``), as sm_75 lacks the asynchronous copies the kernels
    pipeline with (no K/V buffer is double-buffered there) and the float16 attention kernels spill registers."""
    t4 = [r for r in reports if r["arch"] == "sm_75"]
    assert t4 and not any("bfloat16" in r["variant"] for r in t4)
    assert {kernel_of(r) for r in t4} == KERNELS
    not_compiled = [f"{r['variant']}: {r['error']}" for r in t4 if not r["compiled"]]
    assert not not_compiled, "\n".join(not_compiled)
    assert not any(r.get("kv_buffers") for r in t4)
    spilling = {r["variant"] for r in t4 if r["spill_stores"] or r["spill_loads"]}
    assert {v.split(" ")[0] for v in spilling} <= {"_paged_decode_kernel", "_paged_prefill_kernel"}
    with capsys.disabled():
        print("\nsm_75 (T4): " + "; ".join(f"{r['variant']}: {r['registers']} registers"
                                          + (f", {r['spill_stores']} B spilled" if r["spill_stores"] else "")
                                          for r in t4))


H200 = types.SimpleNamespace(multi_processor_count=132, max_threads_per_multi_processor=2048,
                             regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472)


def test_split_rule_fills_one_wave_of_the_compiled_kernel(reports, capsys, monkeypatch):
    """The split rule aims at as many programs per multiprocessor as the compiled split kernel fits there (its
    registers and shared memory on sm_90): a grid of more would run in a second, mostly idle wave."""
    from kvlib.kernels import paged_decode
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H200)
    for r in reports:
        if r["variant"].startswith("_paged_decode_kernel") and "3 split" in r["variant"] and r["arch"] == "sm_90":
            per_sm = paged_decode.programs_per_sm(r["registers"], r["shared"], r["num_warps"], H200)
            by_registers = H200.regs_per_multiprocessor // (-(-r["registers"] * 32 // 256) * 256) // r["num_warps"]
            assert per_sm <= by_registers and per_sm * (r["shared"] + 1024) <= H200.shared_memory_per_multiprocessor
            with capsys.disabled():
                print(f"\n{r['variant']}: {r['registers']} registers, {r['shared'] / 1024:.0f} KiB shared, "
                      f"{r['num_warps']} warps: {per_sm} per SM on an H200")
            for batch, context in [(1, 32768), (8, 4096), (32, 4096), (64, 4096)]:
                splits = paged_decode.choose_num_splits(batch, 8, context, torch.device("cuda"), per_sm)
                assert splits == 1 or batch * 8 * splits <= per_sm * H200.multi_processor_count
