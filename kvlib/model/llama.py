"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) that reads and writes a paged KV cache.

Parameter names follow Hugging Face checkpoints, except that the projections reading the same
input are stacked into one matrix: q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``
(:data:`FUSED_PROJECTIONS`; the loader stacks them at load). One matmul instead of three keeps the
decode step's small matmuls fewer and larger. Tokens of all sequences in a step are packed into
one flat batch; attention is the only part that knows about sequences, through
:class:`~kvlib.attention.AttentionMetadata`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvlib.attention.metadata import AttentionMetadata
from kvlib.model.config import ModelConfig


def fused_projections(config: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Each stacked projection of a layer and the checkpoint projections in it, in order, with their rows."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"self_attn.qkv_proj": [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)],
            "mlp.gate_up_proj": [("mlp.gate_proj", config.intermediate_size), ("mlp.up_proj", config.intermediate_size)]}


class RMSNorm(nn.Module):
    """One fused op; in float32 it equals transformers' five (``x * rsqrt(mean(x^2) + eps) * w``) bit for bit."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, with the linear and Llama-3 context-extension rules."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling.get("rope_type") == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv_freq.float()


def rope_tables(angles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed_sin)`` ``[tokens, 1, head_dim]`` of per-pair ``angles`` ``[tokens, head_dim / 2]``, once a step.

    ``signed_sin`` carries the rotation's sign (``-sin`` on the first half), so ``apply_rope`` needs no negation.
    """
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype), torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]`` in the half-split convention of HF checkpoints.

    transformers computes ``x * cos + cat(-x2, x1) * sin``; ``roll`` swaps the halves in one op and the sign
    rides in ``signed_sin``: the same products, bit for bit, in three ops instead of seven.
    """
    return (x * cos).add_(x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        hidden = config.hidden_size
        self.qkv_proj = nn.Linear(hidden, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, signed_sin, kv_layer, meta: AttentionMetadata, backend) -> torch.Tensor:
        tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(tokens, heads + 2 * kv_heads, self.head_dim)
        qk = apply_rope(qkv[:, :heads + kv_heads], cos, signed_sin)  # q and k together: [tokens, heads + kv_heads, d]
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]  # strided views
        k_cache, v_cache = kv_layer
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.forward(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        bias = config.mlp_bias
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, signed_sin, kv_layer, meta, backend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, signed_sin, kv_layer, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq = rope_inverse_frequencies(config)  # float32 always, not a buffer: dtype casts skip it

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata,
                backend, logits_rows: torch.Tensor) -> torch.Tensor:
        """Run one step over packed tokens; return logits only for ``logits_rows`` (the sampled ones)."""
        return self.logits(self.hidden_states(token_ids, positions, kv_cache, meta, backend)[logits_rows])

    @torch.inference_mode()
    def hidden_states(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata,
                      backend) -> torch.Tensor:
        """The last layer's output for every packed token, ``[num_tokens, hidden]``, K/V stored on the way."""
        x = self.model.embed_tokens(token_ids)
        cos, signed_sin = rope_tables(positions.float()[:, None] * self.inv_freq[None, :], x.dtype)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, cos, signed_sin, kv_cache.layer(index), meta, backend)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[rows, vocab]`` float32 logits of hidden states ``[rows, hidden]``."""
        return self.lm_head(self.model.norm(hidden)).float()
