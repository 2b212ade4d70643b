"""Tool calls in model output, one parser per model family (`kiln serve --tool-call-parser`):

  hermes       `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Hermes, Qwen 2.5/3)
  llama3_json  `{"name": ..., "parameters": {...}}` as the whole reply (optionally after
               `<|python_tag|>`), several separated by `;` (Llama 3.1-3.3)
  mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the v11 tokenizer's
               `[TOOL_CALLS]NAME[ARGS]{...}` (Mistral / Mixtral instruct)
  qwen3_coder  `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
               </function>\\n</tool_call>` (Qwen3-Coder): values converted by the tool's schema
  openai       GPT-OSS's harmony `<|channel|>commentary to=functions.NAME ...<|message|>{...}<|call|>`
               (kiln.runtime.serving.reasoning_parser reads harmony)

`ToolParser.parse` splits a finished reply into content + tool calls. `feed` / `finish` do
the same on text that arrives in pieces (one parser object per streamed choice): content
deltas, and per call first a delta with its id and name, then fragments of its arguments as
the model writes them (as OpenAI and vLLM stream them). Concatenated, the fragments are the
call's arguments as JSON (the model's own spacing; `parse` re-serializes them).

Output that looks like a tool call but is not a valid one (bad JSON, no name, an unknown
function) is handed back as plain content: a model's mistake is never a server error. The
exception is a call whose name was already streamed when its arguments turn out broken
(the name cannot be taken back); with `tool_choice` the grammar (kiln.runtime.guided_decoding)
rules that out.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

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


@dataclass
class ToolCallDelta:
    """One streamed piece of a call: the first one of a call carries `id` and `name`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index, "function": function}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        if self.name is not None:
            function["name"] = self.name
        return out


@dataclass
class ToolStreamDelta:
    """What one piece of streamed text adds: plain content and/or pieces of tool calls."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


# ---- JSON helpers --------------------------------------------------------------------------
def _loads(text: str) -> Any:
    # strict=False: raw control characters inside strings are accepted (and escaped when
    # re-serialized); small models and grammar engines both let them through.
    return json.loads(text, strict=False)


def call_from_object(obj: Any, allowed: set[str] | None) -> ToolCall | None:
    """`{"name": ..., "arguments" | "parameters": {...}}` -> ToolCall, or None when invalid."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or (allowed is not None and name not in allowed):
        return None
    # Qwen and Hermes write "arguments"; Llama 3 and some fine-tunes write "parameters".
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        # Some models serialize the arguments themselves; accept them if they are an object.
        try:
            args = _loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def parse_tool_call_body(body: str, allowed_names: set[str] | None = None) -> ToolCall | None:
    """One block's JSON -> ToolCall, or None when it is not a valid call."""
    try:
        return call_from_object(_loads(body), allowed_names)
    except (json.JSONDecodeError, RecursionError):
        return None


def json_value_end(text: str, start: int) -> int:
    """Index just past the JSON value starting at `start` (after whitespace), or -1 while it
    is incomplete. Only brackets and strings are tracked: validity is checked later."""
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text):
        return -1
    if text[i] not in "{[\"":  # a scalar: ends at a delimiter
        m = re.compile(r"[^,\]\}\s]*").match(text, i)
        end = m.end() if m else i
        return end if end < len(text) else -1
    if text[i] == '"':  # a string: ends at its closing quote
        closing = next((j for j, ch, in_string in _scan_json(text, i) if j > i and ch == '"' and not in_string), -1)
        return closing + 1 if closing >= 0 else -1
    depth = 0
    for j, ch, in_string in _scan_json(text, i):
        if in_string:
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return -1


def _scan_json(text: str, start: int) -> Iterator[tuple[int, str, bool]]:
    """(index, character, inside a JSON string) for each character from `start`: the quote
    that opens or closes a string counts as outside it; escapes are followed."""
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                yield i, ch, False
                continue
            yield i, ch, True
        else:
            if ch == '"':
                in_string = True
            yield i, ch, False


# The start of a JSON call object, up to its arguments' value, as a sequence of pieces, so
# that text which may still become one (a prefix) is told from text that never will.
_WS, _STRING = "ws", "string"
_HEADER_PIECES: tuple[Any, ...] = (_WS, ("{",), _WS, ('"name"',), _WS, (":",), _WS, _STRING, _WS, (",",), _WS,
                                   ('"arguments"', '"parameters"'), _WS, (":",), _WS)


def match_call_header(text: str, start: int) -> tuple[str, str | None, int]:
    """('match', name, end) | ('partial', None, -1) | ('fail', None, -1) for a JSON call
    header (`{"name": "...", "arguments": `) at `start`; 'partial': the text so far could
    still become one."""
    pos, name = start, None
    for piece in _HEADER_PIECES:
        if piece == _WS:
            while pos < len(text) and text[pos].isspace():
                pos += 1
        elif piece == _STRING:
            if pos >= len(text):
                return "partial", None, -1
            if text[pos] != '"':
                return "fail", None, -1
            end = json_value_end(text, pos)
            if end < 0:
                return "partial", None, -1
            try:
                name = _loads(text[pos:end])
            except json.JSONDecodeError:
                return "fail", None, -1
            pos = end
        else:
            rest = text[pos:]
            hit = next((lit for lit in piece if rest.startswith(lit)), None)
            if hit is None:
                return ("partial", None, -1) if any(lit.startswith(rest) for lit in piece) else ("fail", None, -1)
            pos += len(hit)
    return "match", name, pos


# ---- streaming state of one call -------------------------------------------------------------
@dataclass
class _CallStream:
    index: int
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    name_sent: bool = False
    args_sent: str = ""

    def advance(self, name: str, args_so_far: str, out: ToolStreamDelta) -> None:
        """Emit what is new: the name once, then the arguments' growth."""
        if not self.name_sent:
            out.tool_calls.append(ToolCallDelta(self.index, id=self.id, name=name, arguments=""))
            self.name_sent = True
        if len(args_so_far) > len(self.args_sent) and args_so_far.startswith(self.args_sent):
            out.tool_calls.append(ToolCallDelta(self.index, arguments=args_so_far[len(self.args_sent):]))
            self.args_sent = args_so_far


class ToolParser:
    """Base: a reply is content, then (from a start marker on) a region holding calls.

    A family says where its region starts (`find_start`), where it ends (`find_end`), how a
    finished region becomes calls (`parse_region`) and, for streaming, which calls it holds
    so far with how much of each one's arguments (`partial_calls`). `tools` maps the
    callable functions' names to their parameter schemas (None: any name is accepted).
    """

    name: ClassVar[str] = ""
    start_markers: ClassVar[tuple[str, ...]] = ()
    # xgrammar's built-in structural tag for this format (kiln.runtime.guided_decoding).
    xgrammar_format: ClassVar[str | None] = None
    # Its markers are special tokens, which the server then keeps in the text it parses.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: dict[str, dict[str, Any]] | set[str] | None = None):
        if isinstance(tools, set):
            tools = {n: {} for n in tools}
        self.tools = tools
        self.allowed: set[str] | None = set(tools) if tools is not None else None
        self._pending = ""  # streamed text not yet classified / the open region
        self._in_region = False
        self._seen_content = False
        self._calls: list[_CallStream] = []
        self._region_calls = 0  # calls of earlier regions
        self.num_calls = 0

    # -- per family --------------------------------------------------------------------------
    def find_start(self, text: str, at_beginning: bool) -> int:
        """Where a call region starts in `text` (-1: none)."""
        found = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return min(found) if found else -1

    def find_end(self, region: str) -> int:
        """Index just past the region's end in `region` (-1: it goes on)."""
        return -1

    def parse_region(self, region: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def partial_calls(self, region: str) -> list[tuple[str, str]] | None:
        """[(name, arguments text so far)] of a region still being written (each a prefix of
        the final); None: nothing can be streamed early (the region is parsed when complete)."""
        return None

    # -- whole replies -------------------------------------------------------------------------
    def parse(self, text: str) -> ParsedOutput:
        """Content and tool calls of a finished reply. If any region is malformed, the whole
        reply is content with no calls (OpenAI never returns half-valid calls)."""
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while pos <= len(text):
            start = self.find_start(text[pos:], at_beginning=pos == 0 and not "".join(content).strip())
            if start < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:pos + start])
            region = text[pos + start:]
            end = self.find_end(region)
            region = region if end < 0 else region[:end]
            parsed = self.parse_region(region)
            if parsed is None:
                return ParsedOutput(content=text, tool_calls=[])
            calls += parsed
            if end < 0:
                break
            pos += start + end
        if not calls:
            return ParsedOutput(content=text, tool_calls=[])
        joined = "".join(content).strip()
        return ParsedOutput(content=joined or None, tool_calls=calls)

    # -- streaming -----------------------------------------------------------------------------
    def feed(self, text: str) -> ToolStreamDelta:
        self._pending += text
        out = ToolStreamDelta()
        while True:
            if not self._in_region:
                start = self.find_start(self._pending, at_beginning=not self._seen_content)
                if start < 0:
                    keep = self._hold_back(self._pending)
                    released = self._pending[:len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep:]
                    self._content(released, out)
                    return out
                self._content(self._pending[:start], out)
                self._pending = self._pending[start:]
                self._in_region = True
                self._calls = []
            end = self.find_end(self._pending)
            if end < 0:
                self._stream_partial(self._pending, out)
                return out
            region, self._pending = self._pending[:end], self._pending[end:]
            self._close_region(region, out)

    def finish(self) -> ToolStreamDelta:
        """The stream ended: release what is held back (an open region is tried as calls)."""
        out = ToolStreamDelta()
        if self._in_region:
            self._close_region(self._pending, out)
        else:
            self._content(self._pending, out)
        self._pending = ""
        return out

    def _content(self, text: str, out: ToolStreamDelta) -> None:
        if text:
            out.content += text
            self._seen_content = self._seen_content or bool(text.strip())

    def _hold_back(self, text: str) -> int:
        """Characters at the end of `text` that may be the start of a marker."""
        return max((_partial_suffix_len(text, m) for m in self.start_markers), default=0)

    def _stream_partial(self, region: str, out: ToolStreamDelta) -> None:
        partial = self.partial_calls(region)
        if not partial:
            return
        for k, (name, args) in enumerate(partial):
            if k >= len(self._calls):
                self._calls.append(_CallStream(self.num_calls))
                self.num_calls += 1
            self._calls[k].advance(name, args, out)

    def _close_region(self, region: str, out: ToolStreamDelta) -> None:
        self._in_region = False
        parsed = self.parse_region(region)
        partial = self.partial_calls(region) or []
        started = self._calls
        self._calls = []
        if parsed is None and not started:
            self._content(region, out)  # never looked like calls to the client: plain text
            return
        if parsed is None:  # names already streamed: finish those calls with what there is
            for call, (name, args) in zip(started, partial):
                call.advance(name, args, out)
            return
        for k, call in enumerate(parsed):
            if k < len(started):
                raw = partial[k][1] if k < len(partial) else ""
                # The streamed prefix is the model's raw text; complete it the same way.
                started[k].advance(call.name, raw if raw.startswith(started[k].args_sent) and raw else
                                   call.arguments, out)
            else:
                stream = _CallStream(self.num_calls, id=call.id)
                self.num_calls += 1
                stream.advance(call.name, call.arguments, out)


def _partial_suffix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _json_calls_partial(text: str, start: int, allowed: set[str] | None, separators: str
                        ) -> list[tuple[str, str]] | None:
    """Calls `{"name": N, "arguments": {...}}` one after another from `start` (separated by
    whitespace and `separators`): [(name, raw arguments so far)]; None when the text is not
    (yet) such calls."""
    calls: list[tuple[str, str]] = []
    pos = start
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text):
            return calls or None
        state, name, args_start = match_call_header(text, pos)
        if state != "match" or name is None or (allowed is not None and name not in allowed):
            return calls or None
        while args_start < len(text) and text[args_start].isspace():
            args_start += 1
        if args_start < len(text) and text[args_start] != "{":
            return calls or None  # serialized arguments: parsed when complete
        end = json_value_end(text, args_start)
        if end < 0:
            calls.append((name, text[args_start:]))
            return calls
        calls.append((name, text[args_start:end]))
        close = end
        while close < len(text) and text[close].isspace():
            close += 1
        if close >= len(text) or text[close] != "}":
            return calls
        pos = close + 1


def find_block_end(text: str, start: int = 0, end_tag: str = TOOL_CALL_END) -> int:
    """Index of the first `end_tag` at or after `start` that is not inside a JSON string
    (arguments may well contain the tag as text), or -1."""
    return next((i for i, ch, in_string in _scan_json(text, start)
                 if not in_string and ch == end_tag[0] and text.startswith(end_tag, i)), -1)


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = (TOOL_CALL_START,)
    xgrammar_format = None  # kiln's own grammar (GrammarCompiler.tool_calls), same as xgrammar's qwen_3

    def find_end(self, region: str) -> int:
        end = find_block_end(region, len(TOOL_CALL_START))
        return -1 if end < 0 else end + len(TOOL_CALL_END)

    def parse_region(self, region: str) -> list[ToolCall] | None:
        body = region[len(TOOL_CALL_START):]
        if body.endswith(TOOL_CALL_END):
            body = body[:-len(TOOL_CALL_END)]
        call = parse_tool_call_body(body.strip(), self.allowed)
        return None if call is None else [call]

    def partial_calls(self, region: str) -> list[tuple[str, str]] | None:
        calls = _json_calls_partial(region, len(TOOL_CALL_START), self.allowed, "")
        return calls[:1] if calls else None


class Llama3JsonToolParser(ToolParser):
    """The reply is the calls (vLLM's llama3_json): it starts with `{` or `<|python_tag|>`."""

    name = "llama3_json"
    start_markers = ("<|python_tag|>",)
    xgrammar_format = "llama"

    def find_start(self, text: str, at_beginning: bool) -> int:
        tag = text.find("<|python_tag|>")
        if at_beginning and text.lstrip().startswith("{"):
            brace = len(text) - len(text.lstrip())
            return brace if tag < 0 else min(tag, brace)
        return tag

    def _hold_back(self, text: str) -> int:
        if not self._seen_content and text.strip() == "":
            return len(text)  # the reply may still start with `{`
        return super()._hold_back(text)

    @staticmethod
    def _body_start(region: str) -> int:
        return len("<|python_tag|>") if region.startswith("<|python_tag|>") else 0

    def parse_region(self, region: str) -> list[ToolCall] | None:
        body = region[self._body_start(region):].strip()
        calls: list[ToolCall] = []
        decoder = json.JSONDecoder(strict=False)
        pos = 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except (json.JSONDecodeError, RecursionError):
                return None
            call = call_from_object(obj, self.allowed)
            if call is None:
                return None
            calls.append(call)
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
        return calls or None

    def partial_calls(self, region: str) -> list[tuple[str, str]] | None:
        return _json_calls_partial(region, self._body_start(region), self.allowed, ";")


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]` then a JSON array of calls, or (v11+ tokenizers) `NAME[ARGS]{...}`."""

    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)
    xgrammar_format = None  # no built-in tag: GrammarCompiler builds one

    def find_end(self, region: str) -> int:
        # A region runs to the next [TOOL_CALLS] (several calls in the v11 form) or the end.
        nxt = region.find("[TOOL_CALLS]", len("[TOOL_CALLS]"))
        return nxt

    def parse_region(self, region: str) -> list[ToolCall] | None:
        body = region[len("[TOOL_CALLS]"):].strip()
        if "[ARGS]" in body and not body.startswith("["):
            name, _, args = body.partition("[ARGS]")
            return ([c] if (c := call_from_object({"name": name.strip(), "arguments": _try_loads(args)},
                                                   self.allowed)) else None)
        try:
            obj = _loads(body)
        except (json.JSONDecodeError, RecursionError):
            return None
        items = obj if isinstance(obj, list) else [obj]
        calls = [call_from_object(item, self.allowed) for item in items]
        return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]

    def partial_calls(self, region: str) -> list[tuple[str, str]] | None:
        body_start = len("[TOOL_CALLS]")
        body = region[body_start:]
        if "[ARGS]" in body and not body.lstrip().startswith("["):
            name, _, args = body.partition("[ARGS]")
            name = name.strip()
            if not name or (self.allowed is not None and name not in self.allowed):
                return None
            args = args.lstrip()
            if args and not args.startswith("{"):
                return None
            end = json_value_end(args, 0) if args else -1
            # Complete: the object alone; else all but what may be the next "[TOOL_CALLS]".
            args = args[:end] if end >= 0 else args[:len(args) - _partial_suffix_len(args, "[TOOL_CALLS]")]
            return [(name, args)]
        stripped = body.lstrip()
        if not stripped.startswith("["):
            return None
        return _json_calls_partial(region, body_start + (len(body) - len(stripped)) + 1, self.allowed, ",")


def _try_loads(text: str) -> Any:
    try:
        return _loads(text.strip())
    except (json.JSONDecodeError, RecursionError):
        return None


_QWEN_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder's XML-like calls; parameter values are text, converted by the tool's
    schema (numbers, booleans, objects and arrays parsed as JSON; strings kept)."""

    name = "qwen3_coder"
    start_markers = (TOOL_CALL_START,)
    xgrammar_format = "qwen_3_coder"

    def find_end(self, region: str) -> int:
        end = region.find(TOOL_CALL_END)
        return -1 if end < 0 else end + len(TOOL_CALL_END)

    def _value(self, function: str, key: str, raw: str) -> Any:
        schema = ((self.tools or {}).get(function) or {}).get("properties", {}).get(key, {})
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
            return raw
        if raw.strip() == "null":
            return None
        parsed = _try_loads(raw)
        if parsed is None and kind is None:
            return raw
        return parsed if parsed is not None else raw

    def _arguments(self, function: str, body: str, complete: bool) -> str:
        """The arguments JSON built parameter by parameter (a prefix while incomplete)."""
        parts = [f"{json.dumps(k.strip(), ensure_ascii=False)}: "
                 f"{json.dumps(self._value(function, k.strip(), v), ensure_ascii=False)}"
                 for k, v in _QWEN_PARAMETER.findall(body)]
        text = "{" + ", ".join(parts)
        return text + "}" if complete else text

    def _function(self, region: str) -> tuple[str, str] | None:
        """The called function's name and the text after its opening tag, if it is allowed."""
        m = _QWEN_FUNCTION.search(region)
        if m is None:
            return None
        name = m.group(1).strip()
        if self.allowed is not None and name not in self.allowed:
            return None
        return name, region[m.end():]

    def parse_region(self, region: str) -> list[ToolCall] | None:
        found = self._function(region)
        if found is None:
            return None
        name, body = found
        return [ToolCall(name=name, arguments=self._arguments(name, body, complete=True))]

    def partial_calls(self, region: str) -> list[tuple[str, str]] | None:
        found = self._function(region)
        if found is None:
            return None
        name, body = found
        return [(name, self._arguments(name, body, complete="</function>" in body))]


# The families by name (`--tool-call-parser`) are kiln.runtime.serving.parsers' table, with
# GPT-OSS's, which reads harmony (kiln.runtime.serving.reasoning_parser).


# ---- the Hermes parser under its old names (kept for callers of the first version) ---------
def parse_tool_calls(text: str, allowed_names: set[str] | None = None) -> ParsedOutput:
    return HermesToolParser(allowed_names).parse(text)


StreamingToolParser = HermesToolParser
