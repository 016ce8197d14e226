"""The ``kvlib`` command and what it runs: the demo and the benchmarks."""
from kvlib.cli.commands import main

__all__ = ["main"]
