"""The reply parsers by the names `kiln serve` takes (vLLM's): `--tool-call-parser`
(kiln.runtime.serving.tool_parser, and GPT-OSS's harmony calls) and `--reasoning-parser`
(kiln.runtime.serving.reasoning_parser)."""

from __future__ import annotations

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
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r}; choose one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None
