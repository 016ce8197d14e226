"""Random-weight checkpoints of real model shapes, written where they are measured, in seconds.

A GPU machine that can download nothing still has to measure kvlib at the scale a learner's model
runs: a 2-million-parameter model times launch overhead, not a GPU. Speed depends on the shapes
(layers, widths, heads, vocabulary), not on what the weights learned, so the GPU check writes
checkpoints of published shapes with random weights, in the Hugging Face layout both kvlib and
transformers load, and checks token equality against transformers on those same weights.

- ``llama-3.2-1b``: Llama-3.2-1B's shape (16 layers, 2,048 wide, 32 query heads over 8 kv heads
  of 64, tied embeddings, the llama3 rotary scaling, 131,072 positions): 1.24 B parameters.
- ``llama-3.1-8b``: Llama-3-8B's layers (32, 4,096 wide, 14,336 MLP, 32 query heads over 8 kv
  heads of 128) with Llama-3.1's 131,072 positions, so a victim of 16k tokens fits: 8.03 B.
- ``tiny``: the same layout at a size a CPU test writes in a moment.

Weights are drawn from N(0, 0.02) (norms are ones), as transformers initializes a Llama: activations
stay in range in bfloat16, and greedy logits are far enough apart for float32 engines to agree.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

INIT_STD = 0.02
COMPLETE = "kvlib-shape.json"  # written last: a folder without it was cut short and is written again

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class RealShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float = 500000.0
    llama3_rope: bool = True

    def config(self, dtype: torch.dtype) -> dict:
        """The ``config.json`` transformers and kvlib both read."""
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
                "rms_norm_eps": 1e-5, "rope_theta": self.rope_theta,
                "rope_scaling": dict(LLAMA3_ROPE) if self.llama3_rope else None,
                "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
                "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
                "torch_dtype": str(dtype).removeprefix("torch.")}

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's name and shape, in the Hugging Face Llama layout."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        for i in range(self.num_hidden_layers):
            layer = f"model.layers.{i}"
            shapes.update({f"{layer}.input_layernorm.weight": (h,), f"{layer}.post_attention_layernorm.weight": (h,),
                           f"{layer}.self_attn.q_proj.weight": (q, h), f"{layer}.self_attn.k_proj.weight": (kv, h),
                           f"{layer}.self_attn.v_proj.weight": (kv, h), f"{layer}.self_attn.o_proj.weight": (h, q),
                           f"{layer}.mlp.gate_proj.weight": (self.intermediate_size, h),
                           f"{layer}.mlp.up_proj.weight": (self.intermediate_size, h),
                           f"{layer}.mlp.down_proj.weight": (h, self.intermediate_size)})
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    @property
    def parameters(self) -> int:
        return sum(torch.Size(s).numel() for s in self.tensor_shapes().values())

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer, in bfloat16."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2


SHAPES = {shape.name: shape for shape in (
    RealShape("llama-3.2-1b", 2048, 8192, 16, 32, 8, 64, 128256, 131072, tie_word_embeddings=True),
    RealShape("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128, 128256, 131072, tie_word_embeddings=False),
    RealShape("tiny", 64, 128, 2, 4, 2, 16, 256, 4096, tie_word_embeddings=False, rope_theta=10000.0),
)}


def write_checkpoint(folder: Path, shape: RealShape, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                     seed: int = 0) -> Path:
    """Write ``shape`` with random weights into ``folder`` (``config.json`` and one ``model.safetensors``).

    The weights are drawn on ``device`` (a GPU draws 8 B numbers in a moment, a CPU core takes
    minutes) and written in ``dtype``.
    """
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / COMPLETE).unlink(missing_ok=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, size in shape.tensor_shapes().items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(size, dtype=dtype)
        else:
            tensors[name] = (torch.randn(size, generator=generator, device=device, dtype=torch.float32)
                             .mul_(INIT_STD).to(dtype).cpu())
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(shape.config(dtype), indent=2) + "\n")
    (folder / COMPLETE).write_text(json.dumps({"shape": shape.name, "dtype": str(dtype), "seed": seed}) + "\n")
    return folder


def shapes_dir() -> Path:
    """Where the check keeps its checkpoints: ``$KVLIB_SHAPES_DIR``, else ``kvlib-shapes`` in the temp folder."""
    return Path(os.environ.get("KVLIB_SHAPES_DIR") or Path(os.environ.get("TMPDIR", "/tmp")) / "kvlib-shapes")


def shape_folder(name: str, device: str | None = None) -> Path:
    """The folder of shape ``name``, written first if no complete one is there (every part can run alone)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; the shapes are {', '.join(SHAPES)}")
    folder = shapes_dir() / name
    if not (folder / COMPLETE).is_file():
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        write_checkpoint(folder, SHAPES[name], device=device)
    return folder
