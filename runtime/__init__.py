"""Kiln's runtime: engine loop, scheduler, block manager, model runner, sampler, LLM API, CLI."""

from kiln.runtime.config import EngineConfig

from kiln.runtime.engine import LLMEngine
from kiln.runtime.llm import LLM, GenerateError
from kiln.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kiln.runtime.sampling_params import SamplingParams

__all__ = ["LLM", "GenerateError", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
