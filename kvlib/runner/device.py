"""Where the engine runs and which attention backend it uses, decided once and said in one line.

On a machine without a usable GPU, Triton kernels can still run under the Triton interpreter
(for the kernel lessons and tests), which must be switched on before Triton is imported:
``kvlib/__init__.py`` calls :func:`enable_triton_interpreter_without_gpu` first thing.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from kvlib.kernels import triton_available

MIN_TRITON_CAPABILITY = (8, 0)


def enable_triton_interpreter_without_gpu() -> None:
    """Without a GPU, Triton kernels run under the interpreter, which Triton reads when it is imported.

    If something imported Triton before kvlib (transformers does), Triton's own library functions
    were built for compilation and fail inside an interpreted kernel; Triton's Python modules are
    then imported again (its compiled core stays), so the copy kvlib uses runs interpreted. A
    ``TRITON_INTERPRET`` set by the user is left alone.
    """
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "1") != "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    language = sys.modules.get("triton.language")
    library_function = getattr(getattr(language, "standard", None), "sum", None)
    if library_function is not None and type(library_function).__name__ != "InterpretedFunction":
        for name in [m for m in sys.modules if m.split(".")[0] == "triton" and not m.startswith("triton._C")]:
            del sys.modules[name]


def resolve_device(requested: str = "auto") -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch sees no CUDA GPU; use device='auto' or 'cpu'")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def default_dtype(device_type: str, capability: tuple[int, int] | None = None) -> torch.dtype:
    """float32 on a CPU; on a GPU bfloat16 from compute capability 8.0 (its range is float32's, so activations
    cannot overflow), float16 below it, where bfloat16 has no fast path."""
    if device_type != "cuda":
        return torch.float32
    return torch.bfloat16 if capability >= (8, 0) else torch.float16


def resolve_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return default_dtype(device.type, capability)
    return getattr(torch, requested)


@dataclass(frozen=True)
class BackendChoice:
    name: str  # "triton" or "torch"
    reason: str

    def describe(self, device: torch.device) -> str:
        return f"kvlib: device={device.type}, attention backend={self.name} ({self.reason})"


def choose_attention_backend(requested: str, device: torch.device) -> BackendChoice:
    """``auto`` is Triton on GPUs of compute capability 8.0+, torch everywhere else."""
    gpu_ok = device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_TRITON_CAPABILITY
    if requested == "torch":
        return BackendChoice("torch", "requested")
    if requested == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the triton package, which is not installed here; "
                             "use attention_backend='torch' or 'auto'")
        if device.type == "cpu":
            return BackendChoice("triton", "requested; CPU tensors run under the Triton interpreter, slowly")
        if not gpu_ok:
            raise ValueError(f"attention_backend='triton' needs compute capability 8.0+, this GPU has "
                             f"{torch.cuda.get_device_capability(device)}; use 'torch' or 'auto'")
        return BackendChoice("triton", "requested")
    if device.type == "cpu":
        return BackendChoice("torch", "no GPU")
    if not gpu_ok:
        return BackendChoice("torch", "GPU below compute capability 8.0, Triton kernels need 8.0+")
    if not triton_available():
        return BackendChoice("torch", "triton is not installed")
    return BackendChoice("triton", "GPU with compute capability 8.0+")


def make_attention_backend(choice: BackendChoice):
    if choice.name == "triton":
        from kvlib.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    from kvlib.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend()
