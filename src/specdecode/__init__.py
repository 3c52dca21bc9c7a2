"""specdecode: lossless speculative decoding for causal language models."""

from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams, StructuredOutputsParams
from specdecode.types import CompletionOutput, RequestMetrics, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
