"""PackedLinear: oneDNN's layout of a projection computes F.linear's products, and a CPU float32 engine uses it.

A float32 engine packs only the matrices of at least ``PACK_MIN_BYTES``; the tiny checkpoints of the
token-exactness tests have none that large, so they run in nn.Linear, and
tests/test_matches_transformers.py holds an engine packing every matrix to transformers' tokens too.
"""
import pytest
import torch
import torch.nn.functional as F

from kvlib import LLM, EngineConfig, SamplingParams
from kvlib.model import packed_linear, weight_formats
from kvlib.model.packed_linear import PackedLinear, packing_available

pytestmark = pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32),
                                reason="this torch has no oneDNN: projections stay nn.Linear")


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_products_are_f_linears_up_to_summation_order(rows, bias):
    torch.manual_seed(rows)
    weight, b = torch.randn(96, 80), (torch.randn(96) if bias else None)
    packed = PackedLinear(weight, b)
    x = torch.randn(rows, 80)
    torch.testing.assert_close(packed(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    assert packed(x.view(rows, 1, 80)).shape == (rows, 1, 96)
    strided = torch.randn(80, rows).T  # a 2-D view that is not contiguous takes the one-call path too
    torch.testing.assert_close(packed(strided), F.linear(strided, weight, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight_matrix(), weight)


def test_bfloat16_packing_multiplies_in_bfloat16_and_answers_in_the_inputs_dtype():
    torch.manual_seed(0)
    weight, x = torch.randn(64, 48), torch.randn(5, 48)
    packed = PackedLinear(weight, None, torch.bfloat16)
    out = packed(x)
    assert out.dtype == torch.float32 and torch.equal(packed.weight_matrix(), weight.bfloat16())
    torch.testing.assert_close(out, F.linear(x.bfloat16(), weight.bfloat16()).float(), rtol=1e-2, atol=1e-2)


def test_a_cpu_float32_engine_packs_the_matrices_of_a_mib_or_more():
    """The built-in model has both kinds: 2048 x 192 floats in its head (1.5 MB), at most 512 x 192 in a layer."""
    model = LLM("default", EngineConfig(num_gpu_blocks=16, device="cpu"), verbose=False).engine.runner.model
    matrices = [layer.get_submodule(path) for layer in model.model.layers for path in weight_formats.LAYER_PROJECTIONS]
    matrices.append(model.lm_head)
    for matrix in matrices:
        size = matrix.out_features * matrix.in_features * 4
        assert isinstance(matrix, PackedLinear) == (size >= packed_linear.PACK_MIN_BYTES), (matrix, size)
    assert {isinstance(m, PackedLinear) for m in matrices} == {True, False}
    if model.config.tie_word_embeddings:  # the head is a packed copy; the embedding keeps the weights it reads
        assert torch.equal(model.lm_head.weight_matrix(), model.model.embed_tokens.weight)


def packing_everything(monkeypatch) -> None:
    monkeypatch.setattr(packed_linear, "PACK_MIN_BYTES", 0)


def test_packed_and_plain_engines_give_the_same_greedy_tokens(monkeypatch):
    prompts = [[5, 6, 7, 8], [9] * 11, list(range(3, 40))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    packing_everything(monkeypatch)
    packed_llm = LLM("default", EngineConfig(num_gpu_blocks=32, device="cpu"), verbose=False)
    assert isinstance(packed_llm.engine.runner.model.model.layers[0].mlp.down_proj, PackedLinear)
    packed = packed_llm.generate(prompts, params)
    monkeypatch.setattr(weight_formats, "packing_available", lambda device, dtype: False)
    plain_llm = LLM("default", EngineConfig(num_gpu_blocks=32, device="cpu"), verbose=False)
    assert isinstance(plain_llm.engine.runner.model.lm_head, torch.nn.Linear)
    plain = plain_llm.generate(prompts, params)
    assert [o.token_ids for o in packed] == [o.token_ids for o in plain]

