"""The model runner's side: the KV cache tensors, block moves, step inputs, forward and sampling."""
