"""Attention backends: the torch reference and the Triton kernels, behind one small interface."""
from kvlib.attention.metadata import AttentionMetadata
from kvlib.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionMetadata", "TorchAttentionBackend"]
