"""The reply parsers by the names `kiln serve` takes (vLLM's): `--tool-call-parser`
(kiln.runtime.serving.tool_parser, and GPT-OSS's harmony calls) and `--reasoning-parser`
(kiln.runtime.serving.reasoning_parser)."""

from __future__ import annotations

from typing import Any

from kiln.runtime.serving.reasoning_parser import (DeepSeekR1ReasoningParser, HarmonyReasoningParser,
                                                   HarmonyToolParser, Qwen3ReasoningParser, ReasoningParser)
from kiln.runtime.serving.tool_parser import (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                              Qwen3CoderToolParser, ToolParser)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, Qwen3CoderToolParser,
                        HarmonyToolParser)
}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, HarmonyReasoningParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    return _lookup(TOOL_PARSERS, name, "--tool-call-parser")


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    return _lookup(REASONING_PARSERS, name, "--reasoning-parser")


def _lookup(table: dict[str, Any], name: str, option: str) -> Any:
    """table[name], or ValueError naming the option and its choices."""
    if name not in table:
        raise ValueError(f"{option}: unknown parser {name!r}; choose one of {', '.join(sorted(table))}")
    return table[name]
