"""kvlib's rotary embedding is transformers' bit for bit: the same products in fewer ops."""
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvlib.model.llama import apply_rope, rope_tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_equals_transformers_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(0)
    tokens, heads, head_dim = 7, 5, 64
    positions = torch.tensor([0, 1, 2, 40, 41, 900, 4095])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    q = torch.randn(1, heads, tokens, head_dim, generator=generator).to(dtype)  # [batch, heads, tokens, d]
    k = torch.randn(1, heads, tokens, head_dim, generator=generator).to(dtype)
    freqs = positions[None, :, None].float() * inv_freq  # transformers' LlamaRotaryEmbedding.forward
    emb = torch.cat((freqs, freqs), dim=-1)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, emb.cos().to(dtype), emb.sin().to(dtype))

    cos, signed_sin = rope_tables(positions.float()[:, None] * inv_freq[None, :], dtype)
    for x, expected in ((q, expected_q), (k, expected_k)):
        rotated = apply_rope(x[0].transpose(0, 1), cos, signed_sin)  # kvlib's [tokens, heads, d]
        assert rotated.dtype == dtype
        assert torch.equal(rotated, expected[0].transpose(0, 1))
