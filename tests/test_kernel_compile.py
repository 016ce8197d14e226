"""Every Triton kernel variant compiles for sm_80 and sm_90 without register spills, and decode is pipelined.

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
from pathlib import Path

import pytest


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


def test_every_variant_compiled(reports):
    kernels = {r["variant"].split(" ")[0] for r in reports}
    assert kernels == {"_paged_decode_kernel", "_merge_splits_kernel", "_paged_prefill_kernel", "_store_kv_kernel",
                       "_copy_blocks_kernel"}
    assert {r["arch"] for r in reports} == {"sm_80", "sm_90"}


def test_no_register_spills(reports):
    spilled = [f"{r['variant']} on {r['arch']}: {r['spill_stores']} B stored, {r['spill_loads']} B loaded "
               f"({r['registers']} registers)" for r in reports if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, "\n".join(spilled)


def test_decode_loads_overlap_compute(reports):
    decode = [r for r in reports if r["variant"].startswith("_paged_decode_kernel")]
    assert len(decode) == 12  # 3 dtypes x plain and split x 2 architectures
    for r in decode:
        assert len(r["kv_buffers"]) == 2 and min(r["kv_buffers"]) >= 2, r
        assert r["max_wait_in_flight"] >= 1, r
