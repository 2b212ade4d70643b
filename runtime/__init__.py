"""Kiln's runtime: engine loop, scheduler, block manager, model runner, sampler, LLM API, CLI."""

from kiln.runtime.config import EngineConfig

from kiln.runtime.engine import LLMEngine
from kiln.runtime.llm import LLM, GenerateError, TextPrompt, TokensPrompt
from kiln.runtime.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kiln.runtime.sampling_params import SamplingParams, StructuredOutputs, StructuredOutputsParams
from kiln.runtime.version import __version__

__all__ = ["LLM", "GenerateError", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputs", "RequestOutput",
           "CompletionOutput", "RequestMetrics", "Logprob", "TextPrompt", "TokensPrompt", "__version__"]
