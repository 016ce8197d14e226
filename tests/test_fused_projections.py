"""q/k/v and gate/up are stacked into one matrix each at load, in the checkpoint's order, biases included."""
import torch
from safetensors.torch import load_file

from kvlib.model.loader import load_model


def test_stacked_weights_are_the_checkpoint_tensors_in_order(checkpoint):
    folder = checkpoint("llama-bias")  # biases on q/k/v, o and the MLP
    saved = load_file(next(folder.glob("*.safetensors")))
    layer = load_model(folder, torch.device("cpu"), torch.float32).model.layers[1]
    prefix = "model.layers.1."
    for fused, parts in [(layer.self_attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                         (layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj"))]:
        for kind in ("weight", "bias"):
            expected = torch.cat([saved[f"{prefix}{part}.{kind}"] for part in parts])
            assert torch.equal(getattr(fused, kind), expected), (parts, kind)
