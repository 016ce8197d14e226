"""kvlib: a paged-KV LLM inference engine, small enough to read, real enough to measure."""
from kvlib.runner.device import enable_triton_interpreter_without_gpu

enable_triton_interpreter_without_gpu()  # must precede any import of triton

from kvlib.config import EngineConfig, SamplingParams  # noqa: E402
from kvlib.llm import LLM  # noqa: E402
from kvlib.outputs import RequestOutput  # noqa: E402

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
