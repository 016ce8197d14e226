"""Projections whose weights oneDNN lays out for its own CPU matmul, once, when the model is loaded.

A decode step's matmuls have few rows (one per sequence) and read every weight once. torch's
``F.linear`` on a CPU calls the BLAS it was built with, whose kernel for a few rows streams the
weights at about half the speed one core can read memory (MKL on an AMD CPU, measured in
BENCHMARKS.md: 33.6 ms for SmolLM2-135M's projections at one row, 128 ms at 32). oneDNN, also built
into torch, runs on what the CPU's flags say it has; with the weights reordered into its blocked
layout ahead of time (``torch.ops.mkldnn._reorder_linear_weight``), the same pass takes 14 ms and 42
ms. The layout is chosen for a batch of ``LAYOUT_ROWS`` rows and serves any number of rows. Each call
costs oneDNN about 12 us however small the product, so a model small enough to sit in cache (the
built-in one) runs a one-row step about a fifth slower than through ``F.linear``, and its larger
batches faster.

The products are float32 (or bfloat16 for the bfloat16 weight format) like ``F.linear``'s, summed in
another order, so they differ from transformers' in the last bits; the token-exactness tests against
transformers run on them (every CPU float32 engine packs), and ``tests/test_packed_linear.py`` checks
the products and that packed and plain engines pick the same greedy tokens.
"""
from __future__ import annotations

import torch
from torch import nn

LAYOUT_ROWS = 32  # the batch the weight layout is chosen for: faster at 1, 8 and 32 rows than a layout for 1


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch can pack a ``dtype`` projection for ``device``: oneDNN on a CPU, float32 or bfloat16."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


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
        rows = (x if flat else x.reshape(-1, self.in_features)).to(self.compute_dtype)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "").to(x.dtype)
        return out if flat else out.view(*x.shape[:-1], self.out_features)
