"""Reasoning in model output, one parser per model family (`kiln serve --reasoning-parser`,
vLLM's names):

  deepseek_r1    `<think> ... </think>` then the answer; the reply is taken to be thinking
                 from its first token (DeepSeek-R1's template opens `<think>` in the prompt,
                 its first template did not), so a reply cut off before `</think>` is all
                 reasoning. QwQ, and Qwen3-Thinking (whose template opens `<think>` too).
  qwen3          the same tags, but a reply is thinking only where the prompt opens `<think>`
                 or the reply starts with it: Qwen3 writes `<think>` itself, and with
                 `enable_thinking: false` its template closes an empty one in the prompt.
  openai_gptoss  GPT-OSS's harmony messages (`<|channel|>analysis<|message|>...<|end|>`):
                 the analysis channel is reasoning, `final` (and commentary to no one) the
                 answer, and `commentary to=functions.NAME ... <|message|>ARGS<|call|>` a tool
                 call. Harmony's markers are special tokens, which the server then keeps in the
                 text it parses (`keeps_special_tokens`).

The reasoning goes to the chat message's `reasoning_content` (and `reasoning`, vLLM's newer
name for it), the rest to `content`, where the tool-call parser
(kiln.runtime.serving.tool_parser) reads calls. `feed` / `finish` split text that arrives in
pieces (one parser per streamed choice); `parse` of a whole reply is one `feed` and `finish`,
so a stream's deltas add up to the non-streamed message. Whitespace around the reasoning
(after `<think>`, before `</think>`, before the answer) is dropped, held back while it
streams until it is known not to be the edge.

`reasoning_end` is the text after which the answer starts: a request's grammar
(response_format, structured outputs, tool calls) constrains only what follows it, so the
model thinks freely first (`guided_decoding.AfterMarker`), as vLLM's structured outputs do.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kiln.runtime.serving.tool_parser import (ParsedOutput, ToolCall, ToolCallDelta, ToolParser,
                                              ToolStreamDelta, _partial_suffix_len)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass
class ReasoningDelta:
    """What one piece of streamed text adds (tool calls only from parsers that read them)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: "ReasoningDelta") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


@dataclass
class ReasoningSplit:
    """A whole reply: its reasoning, its answer (None when empty) and, from parsers that read
    them, its tool calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ReasoningParser:
    """Base: a state machine over the reply's text (see the module doc)."""

    name: ClassVar[str] = ""
    reasoning_end: ClassVar[str] = THINK_CLOSE
    keeps_special_tokens: ClassVar[bool] = False  # its markers are special tokens
    parses_tool_calls: ClassVar[bool] = False  # it reads tool calls itself (the tool parser is skipped)

    def __init__(self, prompt_tail: str = "", tools: dict[str, Any] | set[str] | None = None):
        """`prompt_tail`: the end of the rendered prompt (its last tokens, special tokens
        included), which tells whether the reply starts inside the reasoning; `tools`: the
        request's callable functions (for parsers that read tool calls)."""
        self._pending = ""
        self.num_calls = 0

    @classmethod
    def answer_waits_for_marker(cls, prompt_tail: str) -> bool:
        """Whether the answer starts only after `reasoning_end` in the reply (False: the prompt
        has closed the reasoning already, and a grammar constrains the reply from its start)."""
        return True

    def feed(self, text: str) -> ReasoningDelta:
        self._pending += text
        out = ReasoningDelta()
        self._drain(out, final=False)
        return out

    def finish(self) -> ReasoningDelta:
        """The reply ended: release what is held back."""
        out = ReasoningDelta()
        self._drain(out, final=True)
        self._pending = ""
        return out

    def parse(self, text: str) -> ReasoningSplit:
        out = self.feed(text)
        out.add(self.finish())
        return ReasoningSplit(out.reasoning or None, out.content or None, _calls_from_deltas(out.tool_calls))

    def _drain(self, out: ReasoningDelta, final: bool) -> None:
        raise NotImplementedError


def _calls_from_deltas(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Streamed call pieces -> whole calls (arguments re-serialized where they are JSON)."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        call = calls.setdefault(d.index, ToolCall(name="", arguments=""))
        if d.id is not None:
            call.id = d.id
        if d.name is not None:
            call.name = d.name
        call.arguments += d.arguments
    for call in calls.values():
        try:
            call.arguments = json.dumps(json.loads(call.arguments or "{}", strict=False), ensure_ascii=False)
        except json.JSONDecodeError:
            pass  # the model's text as it wrote it (what the stream sent)
    return [calls[i] for i in sorted(calls)]


# ---- <think> ... </think> ---------------------------------------------------------------------
_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class ThinkTagsParser(ReasoningParser):
    """`<think> reasoning </think> answer` (module doc: deepseek_r1, qwen3)."""

    # Where the prompt leaves neither tag open nor closed: thinking (R1) or not unless the
    # reply opens `<think>` (Qwen3).
    thinks_by_default: ClassVar[bool] = False

    def __init__(self, prompt_tail: str = "", tools: dict[str, Any] | set[str] | None = None):
        super().__init__(prompt_tail, tools)
        opened = self._prompt_state(prompt_tail)
        default = _REASONING if self.thinks_by_default else _START
        self._state = {True: _REASONING, False: _CONTENT, None: default}[opened]
        self._lead = True  # at the start of the current part: leading whitespace (and a `<think>`) is dropped

    @staticmethod
    def _prompt_state(prompt_tail: str) -> bool | None:
        """True: the prompt ends inside `<think>`; False: it ends just after `</think>`; None: neither."""
        tail = prompt_tail.rstrip()
        if tail.endswith(THINK_OPEN):
            return True
        if tail.endswith(THINK_CLOSE):
            return False
        return None

    @classmethod
    def answer_waits_for_marker(cls, prompt_tail: str) -> bool:
        return cls._prompt_state(prompt_tail) is not False

    def _drain(self, out: ReasoningDelta, final: bool) -> None:
        while True:
            p = self._pending
            if self._state == _START:
                s = p.lstrip()
                if s.startswith(THINK_OPEN):
                    self._pending, self._state = s[len(THINK_OPEN):], _REASONING
                    continue
                if not final and (not s or THINK_OPEN.startswith(s)):
                    self._pending = s  # may still become `<think>`
                    return
                self._pending, self._state, self._lead = s, _CONTENT, False
                continue
            if self._state == _REASONING:
                if self._lead:
                    s = p.lstrip()
                    if s.startswith(THINK_OPEN):  # the model opened it although the prompt had
                        self._pending = s[len(THINK_OPEN):]
                        continue
                    if not final and (not s or THINK_OPEN.startswith(s)):
                        self._pending = s
                        return
                    self._lead, p = False, s
                end = p.find(THINK_CLOSE)
                if end >= 0:
                    out.reasoning += p[:end].rstrip()
                    self._pending, self._state, self._lead = p[end + len(THINK_CLOSE):], _CONTENT, True
                    continue
                if final:
                    out.reasoning += p.rstrip()
                    self._pending = ""
                    return
                keep = _partial_suffix_len(p, THINK_CLOSE)
                sent = p[:len(p) - keep].rstrip()  # trailing whitespace may be the edge: held back
                out.reasoning += sent
                self._pending = p[len(sent):]
                return
            if self._lead:
                p = p.lstrip()
                if not p and not final:
                    self._pending = ""
                    return
                self._lead = False
            out.content += p
            self._pending = ""
            return


class DeepSeekR1ReasoningParser(ThinkTagsParser):
    name = "deepseek_r1"
    thinks_by_default = True


class Qwen3ReasoningParser(ThinkTagsParser):
    name = "qwen3"


# ---- harmony (GPT-OSS) ------------------------------------------------------------------------
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_END, H_CALL, H_RETURN, H_CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
# What ends a message's body: its end markers, or the next message's start without one.
_BODY_ENDS = (H_END, H_CALL, H_RETURN, H_START)
_HARMONY_MARKERS = (H_START, H_CHANNEL, H_MESSAGE, H_END, H_CALL, H_RETURN, H_CONSTRAIN)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(H_CHANNEL) + r"\s*([A-Za-z_]+)")
_HEADER, _BODY = "header", "body"


@dataclass
class _HarmonyHeader:
    channel: str | None
    recipient: str | None


class HarmonyReasoningParser(ReasoningParser):
    """GPT-OSS's harmony messages (module doc: openai_gptoss), tool calls included."""

    name = "openai_gptoss"
    reasoning_end = H_CHANNEL + "final" + H_MESSAGE
    keeps_special_tokens = True
    parses_tool_calls = True

    def __init__(self, prompt_tail: str = "", tools: dict[str, Any] | set[str] | None = None):
        super().__init__(prompt_tail, tools)
        self.allowed: set[str] | None = set(tools) if tools is not None else None
        self._state = _HEADER
        self._header = _HarmonyHeader(None, None)
        self._call: ToolCallDelta | None = None  # the open message's call, once its name is sent

    def _drain(self, out: ReasoningDelta, final: bool) -> None:
        while True:
            p = self._pending
            if self._state == _HEADER:
                at = p.find(H_MESSAGE)
                if at < 0:
                    if final and not any(m in p for m in _HARMONY_MARKERS):
                        out.content += p  # not harmony at all: the reply is plain text
                    return  # (a header cut off by the end of the reply says nothing)
                self._header = self._parse_header(p[:at])
                self._pending, self._state, self._call = p[at + len(H_MESSAGE):], _BODY, None
                continue
            ends = [(i, m) for m in _BODY_ENDS if (i := p.find(m)) >= 0]
            if ends:
                at, marker = min(ends)
                self._body(p[:at], out)
                self._pending = p[at + (0 if marker == H_START else len(marker)):]
                self._state = _HEADER
                continue
            keep = 0 if final else max(_partial_suffix_len(p, m) for m in _BODY_ENDS)
            self._body(p[:len(p) - keep], out)
            self._pending = p[len(p) - keep:]
            return

    @staticmethod
    def _parse_header(text: str) -> _HarmonyHeader:
        """`<|start|>assistant to=functions.f<|channel|>commentary json` and the like: the
        recipient may stand before or after the channel."""
        channel = _CHANNEL.search(text)
        recipient = _RECIPIENT.search(text)
        return _HarmonyHeader(channel.group(1) if channel else None, recipient.group(1) if recipient else None)

    def _body(self, text: str, out: ReasoningDelta) -> None:
        if not text:
            return
        h = self._header
        name = h.recipient[len("functions."):] if h.recipient and h.recipient.startswith("functions.") else None
        if name is not None and self.allowed is not None and name in self.allowed:
            if self._call is None:
                self._call = ToolCallDelta(self.num_calls, id=f"call_{uuid.uuid4().hex[:24]}", name=name)
                self.num_calls += 1
                out.tool_calls.append(self._call)
            out.tool_calls.append(ToolCallDelta(self._call.index, arguments=text))
        elif h.channel == "analysis" or (h.recipient is not None and name is None):
            out.reasoning += text  # thinking, and calls to the model's built-in tools (browser, python)
        else:
            out.content += text  # final, and commentary to no one (a preamble to the user)


class HarmonyToolParser(ToolParser):
    """`--tool-call-parser openai`: GPT-OSS's calls read from its harmony messages, as the
    reasoning parser reads them; its analysis (reasoning) is left out of the content. With
    `--reasoning-parser openai_gptoss` the reasoning parser reads the calls instead."""

    name = "openai"
    keeps_special_tokens = True

    def __init__(self, tools: dict[str, dict[str, Any]] | set[str] | None = None):
        super().__init__(tools)
        self._harmony = HarmonyReasoningParser("", self.allowed)

    def parse(self, text: str) -> ParsedOutput:
        split = HarmonyReasoningParser("", self.allowed).parse(text)
        return ParsedOutput(split.content, split.tool_calls)

    def feed(self, text: str) -> ToolStreamDelta:
        return self._delta(self._harmony.feed(text))

    def finish(self) -> ToolStreamDelta:
        return self._delta(self._harmony.finish())

    def _delta(self, d: ReasoningDelta) -> ToolStreamDelta:
        self.num_calls = self._harmony.num_calls
        return ToolStreamDelta(d.content, d.tool_calls)


