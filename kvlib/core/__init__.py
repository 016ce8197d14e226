"""The engine's core: what to run each step, and which KV blocks hold what. No tensors, no model."""
