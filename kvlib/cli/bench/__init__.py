"""Benchmarks behind ``kvlib bench``: each one measures a ratio side by side in a single run."""
