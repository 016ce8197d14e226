"""Projections whose weights oneDNN lays out for its own CPU matmul, once, when the model is loaded.

A decode step's matmuls have few rows (one per sequence) and read every weight once. torch's
``F.linear`` on a CPU calls the BLAS it was built with, whose kernel for a few rows streams the
weights at about half the speed one core can read memory (MKL on an AMD CPU, measured in
BENCHMARKS.md: 33.6 ms for SmolLM2-135M's projections at one row, 128 ms at 32). oneDNN, also built
into torch, runs on what the CPU's flags say it has; with the weights reordered into its blocked
layout ahead of time (``torch.ops.mkldnn._reorder_linear_weight``), the same pass takes 14 ms and 42
ms (on an Intel CPU, where MKL is at home: 35.7 ms packed against MKL's 30.9 at one row, 43.7 against
73.4 at eight). The layout is chosen for a batch of ``LAYOUT_ROWS`` rows and serves any number of rows.

Each call costs oneDNN about 12 us however small the product, which a matrix that a core's cache holds
never earns back: a float32 engine packs only matrices of at least ``PACK_MIN_BYTES``
(``worth_packing``). SmolLM2's are all larger; the built-in model keeps its layers in ``nn.Linear`` and
packs only its 1.5 MB head (``kvlib bench engine`` on an Intel Xeon: 2,143 output tokens/s with every
matrix packed, 2,421 this way, 2,498 with none).

The products are float32 (or bfloat16 for the bfloat16 weight format) like ``F.linear``'s, summed in
another order, so they differ from transformers' in the last bits; ``tests/test_packed_linear.py`` checks
the products, which matrices an engine packs, and that packed and plain engines pick the same greedy tokens.
"""
from __future__ import annotations

import torch
from torch import nn

LAYOUT_ROWS = 32  # the batch the weight layout is chosen for: faster at 1, 8 and 32 rows than a layout for 1
PACK_MIN_BYTES = 1 << 20  # a float32 matrix smaller than this stays in nn.Linear: it is read from cache


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch can pack a ``dtype`` projection for ``device``: oneDNN on a CPU, float32 or bfloat16."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def worth_packing(weight: torch.Tensor) -> bool:
    """Whether a float32 projection gains from oneDNN's layout: one whose weights stream from memory."""
    return weight.numel() * weight.element_size() >= PACK_MIN_BYTES


class PackedLinear(nn.Module):
    """A projection ``y = x W^T + b`` with ``W`` in oneDNN's layout, computed in ``dtype``, output in ``x``'s dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = dtype
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous(), LAYOUT_ROWS)
        self.register_buffer("packed", packed)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    @classmethod
    def of(cls, linear: nn.Module, dtype: torch.dtype = torch.float32) -> "PackedLinear":
        return cls(linear.weight, linear.bias, dtype)

    def weight_matrix(self) -> torch.Tensor:
        """``W`` ``[out, in]`` in the plain layout, in ``compute_dtype`` (a copy, for tests and inspection)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the model's own case: no reshape (and in float32 no cast) around the one call
        rows = x if flat else x.reshape(-1, self.in_features)
        if rows.dtype != self.compute_dtype:  # a no-op .to() still costs a dispatch, 240 in a step of SmolLM2
            rows = rows.to(self.compute_dtype)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out if flat else out.view(*x.shape[:-1], self.out_features)
