"""Tool calls in model output: Hermes / Qwen style `<tool_call>{...}</tool_call>` blocks.

A model that calls a tool writes, anywhere in its reply, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse_tool_calls` turns a finished reply into content + tool calls; `StreamingToolParser`
does the same on text that arrives in pieces, so a stream carries content deltas and one
tool-call delta per completed call. Output that looks like a tool call but is not a valid
one (bad JSON, no name, an unknown function) is handed back as plain content: a model's
mistake is never a server error.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialized (what OpenAI's `function.arguments` holds)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call["index"] = index
        return call


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def parse_tool_call_body(body: str, allowed_names: set[str] | None = None) -> ToolCall | None:
    """One block's JSON -> ToolCall, or None when it is not a valid call."""
    try:
        # strict=False: raw control characters inside strings are accepted (and escaped when
        # re-serialized); small models and grammar engines both let them through.
        obj = json.loads(body, strict=False)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    if allowed_names is not None and name not in allowed_names:
        return None
    # Qwen and Hermes write "arguments"; some fine-tunes write "parameters".
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        # Some models serialize the arguments themselves; accept them if they are an object.
        try:
            args = json.loads(args, strict=False)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def find_block_end(text: str, start: int = 0) -> int:
    """Index of the first `</tool_call>` at or after `start` that is not inside a JSON string
    (arguments may well contain the tag as text), or -1."""
    in_string = escaped = False
    i = start
    while i < len(text):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "<" and text.startswith(TOOL_CALL_END, i):
            return i
        i += 1
    return -1


def split_blocks(text: str) -> tuple[list[str], list[str]] | None:
    """(text outside the blocks, the blocks' bodies); None if there is no `<tool_call>`."""
    if TOOL_CALL_START not in text:
        return None
    outside: list[str] = []
    bodies: list[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_START, pos)
        if start < 0:
            outside.append(text[pos:])
            return outside, bodies
        outside.append(text[pos:start])
        body_start = start + len(TOOL_CALL_START)
        end = find_block_end(text, body_start)
        if end < 0:  # the last block runs to the end of the text
            bodies.append(text[body_start:])
            return outside, bodies
        bodies.append(text[body_start:end])
        pos = end + len(TOOL_CALL_END)


def parse_tool_calls(text: str, allowed_names: set[str] | None = None) -> ParsedOutput:
    """Split a finished reply into content and tool calls.

    If any `<tool_call>` block is malformed, the whole reply is returned as content with no
    tool calls (as OpenAI never returns half-valid calls). A last block cut off before its
    `</tool_call>` still counts when its JSON is complete.
    """
    split = split_blocks(text)
    if split is None:
        return ParsedOutput(content=text, tool_calls=[])
    outside, bodies = split
    calls: list[ToolCall] = []
    for body in bodies:
        call = parse_tool_call_body(body.strip(), allowed_names)
        if call is None:
            return ParsedOutput(content=text, tool_calls=[])
        calls.append(call)
    content = "".join(outside).strip()
    return ParsedOutput(content=content or None, tool_calls=calls)


@dataclass
class ToolStreamDelta:
    """What one piece of streamed text adds: plain content and/or completed tool calls."""

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class StreamingToolParser:
    """Feed text deltas, get content deltas and one delta per completed tool call.

    Text that might be the start of `<tool_call>` is held back until it is known not to be.
    A block's text is buffered until its `</tool_call>` (one outside any JSON string); then
    it is parsed, and a malformed block is released as plain content.
    """

    def __init__(self, allowed_names: set[str] | None = None):
        self.allowed_names = allowed_names
        self._pending = ""  # text not yet classified
        self._in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> ToolStreamDelta:
        self._pending += text
        out = ToolStreamDelta()
        while True:
            if not self._in_call:
                start = self._pending.find(TOOL_CALL_START)
                if start < 0:
                    keep = _partial_suffix_len(self._pending, TOOL_CALL_START)
                    out.content += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep:]
                    return out
                out.content += self._pending[:start]
                self._pending = self._pending[start:]
                self._in_call = True
            end = find_block_end(self._pending, len(TOOL_CALL_START))
            if end < 0:
                return out
            block = self._pending[: end + len(TOOL_CALL_END)]
            self._pending = self._pending[end + len(TOOL_CALL_END):]
            self._in_call = False
            self._emit_block(block, out)

    def finish(self) -> ToolStreamDelta:
        """The stream ended: release whatever is held back (an unclosed block is tried as a call)."""
        out = ToolStreamDelta()
        if self._in_call:
            self._emit_block(self._pending, out)
        else:
            out.content += self._pending
        self._pending = ""
        self._in_call = False
        return out

    def _emit_block(self, block: str, out: ToolStreamDelta) -> None:
        body = block[len(TOOL_CALL_START):]
        if body.endswith(TOOL_CALL_END):
            body = body[: -len(TOOL_CALL_END)]
        call = parse_tool_call_body(body.strip(), self.allowed_names)
        if call is None:
            out.content += block
        else:
            out.tool_calls.append(call)
            self.num_calls += 1


def _partial_suffix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
