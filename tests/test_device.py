"""Device and dtype defaults, and the Triton backend on CPU tensors where Triton compiles for a GPU."""
import os
import subprocess
import sys

import pytest
import torch

from kvlib.kernels import triton_available
from kvlib.runner.device import default_dtype


@pytest.mark.parametrize("device_type, capability, dtype", [
    ("cpu", None, torch.float32), ("cuda", (9, 0), torch.bfloat16), ("cuda", (8, 0), torch.bfloat16),
    ("cuda", (7, 5), torch.float16),  # a T4
])
def test_default_dtype(device_type, capability, dtype):
    assert default_dtype(device_type, capability) == dtype


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
def test_triton_backend_on_cpu_where_triton_compiles():
    """On a machine with a GPU, Triton compiles kernels, which cannot read CPU tensors: device='cpu' with the
    Triton backend must run interpreted copies, and leave the compiled kernels to the GPU.

    TRITON_INTERPRET=0 puts this machine's Triton in that state, GPU or not.
    """
    code = ("import triton\n"
            "from kvlib import LLM, EngineConfig, SamplingParams\n"
            "from kvlib.kernels import cache_ops\n"
            "assert type(cache_ops._store_kv_kernel).__name__ == 'JITFunction'\n"
            "kw = dict(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8, device='cpu')\n"
            "t = LLM('default', EngineConfig(attention_backend='triton', **kw), verbose=False)\n"
            "r = LLM('default', EngineConfig(attention_backend='torch', **kw), verbose=False)\n"
            "p = SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=1)\n"
            "prompts = [[3, 4, 5, 6, 7], [8, 9]]\n"
            "assert [[s.token_ids for s in o.samples] for o in t.generate(prompts, p)] == \\\n"
            "       [[s.token_ids for s in o.samples] for o in r.generate(prompts, p)]\n"
            "assert type(cache_ops._store_kv_kernel).__name__ == 'JITFunction'\n")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
def test_bfloat16_triton_on_cpu_is_refused_not_wrong():
    """The interpreter's bfloat16 attention gave other tokens than float32 (1401 repeated): refuse it clearly."""
    from kvlib import LLM, EngineConfig, SamplingParams
    llm = LLM("default", EngineConfig(attention_backend="triton", dtype="bfloat16", device="cpu", num_gpu_blocks=8),
              verbose=False)
    with pytest.raises(TypeError, match="dtype='float32'"):
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2))
