"""specdecode: lossless speculative decoding for causal language models."""

from specdecode.llm import LLM
from specdecode.structured.params import StructuredOutputsParams
from specdecode.types import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
