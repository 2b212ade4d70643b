"""The OpenAI API's request bodies (validated with pydantic) and its error format.

Request models check types strictly (no "0.5" for a float). A request's top-level fields
that the server does not know are accepted and logged once, as vLLM does (clients add
provider-specific fields freely); inside nested objects (messages, tools, response_format)
unknown fields are a 400 naming them. Range
checks on sampling values live in `SamplingParams`, which the server calls; the few checks
here are those OpenAI states for its own API (n >= 1, logprobs 0..20, non-empty messages).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kiln.runtime.serving.vllm_compat import VLLMSamplingFields

MAX_LOGPROBS = 20
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Deepest JSON nesting a request body may have. Real requests (a tool's JSON schema is the
# deepest part) stay far below; parsing (json's C scanner, pydantic, the grammar compiler,
# templates) recurses per level, and Python's recursion limit is ~1000.
MAX_JSON_DEPTH = 64


# ---- errors ------------------------------------------------------------------------------

class OpenAIError(Exception):
    """An error the server answers with, in OpenAI's format, with an HTTP status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, "invalid_request_error", param, code)


def server_error(message: str) -> OpenAIError:
    return OpenAIError(message, 500, "server_error", None, "internal_error")


# Names pydantic puts into error locations for union branches (not fields the user wrote).
_DISCRIMINATOR_TAGS = {"system", "developer", "user", "assistant", "tool", "text", "image_url"}


def format_loc(loc: tuple[Any, ...]) -> str:
    """pydantic's error location -> a parameter path like `messages[0].content`."""
    out = ""
    prev: Any = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (isinstance(part, str) and (part.startswith(("function-", "literal[", "list[", "dict[", "tagged-union"))
                                         or part in {"str", "int", "float", "bool", "none", "NamedToolChoice"}
                                         or (isinstance(prev, int) and part in _DISCRIMINATOR_TAGS))):
            pass  # a union branch's name, not a field
        else:
            out += f".{part}" if out else str(part)
        prev = part
    return out


def validation_error(e: ValidationError) -> OpenAIError:
    """pydantic's errors -> 400 naming the field.

    Inside a union pydantic reports one error per branch; the one with the longest location
    (then the furthest list index) got furthest into the value, so it is the most useful.
    """
    errors = e.errors(include_url=False)
    err = max(errors, key=lambda x: (len(x.get("loc", ())), sum(p for p in x.get("loc", ()) if isinstance(p, int))))
    param = format_loc(tuple(err.get("loc", ()))) or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if param:  # "n: n must be ..." -> "n: must be ..." (the validators name their field)
        msg = msg.removeprefix(re.split(r"[.\[]", param)[-1] + " ")
    if err.get("type") == "extra_forbidden":
        msg = "unrecognized request argument (not supported by this server)"
    elif err.get("type") == "missing":
        msg = "this field is required"
    if "input" in err and err.get("type") not in ("missing", "extra_forbidden"):
        shown = repr(err["input"])
        msg += f" (got {shown[:80] + '...' if len(shown) > 80 else shown})"
    return bad_request(f"{param}: {msg}" if param else msg, param)


# ---- checks on the raw body -------------------------------------------------------------

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_json_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """400 if the JSON text `raw` nests arrays/objects deeper than `limit`; runs before the
    body is parsed, so no parser recurses that deep. Brackets inside strings do not count."""
    # Cheap first (a few ms for 4 MB, holding the GIL): fewer opening brackets anywhere, even
    # counting those inside strings, than the limit cannot nest deeper.
    everything = raw.translate(None, _NOT_BRACKETS)
    if everything.count(b"[") + everything.count(b"{") <= limit:
        return
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if brackets.count(b"[") + brackets.count(b"{") <= limit:
        return
    depth = 0
    for b in brackets:
        if b in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                raise bad_request(f"the request body nests JSON arrays/objects more than {limit} levels deep; "
                                  f"the limit is {limit}", None, "json_too_deep")
        else:
            depth -= 1


def decode_body(raw: bytes) -> str:
    """The body as text. Bytes that are not UTF-8 become lone surrogates (surrogateescape),
    which `find_bad_text` then reports with the field that holds them. A UTF-8 byte-order
    mark is dropped, as json.loads does for bytes."""
    raw = raw.removeprefix(b"\xef\xbb\xbf")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="surrogateescape")


def may_hold_bad_text(raw: bytes, text: str) -> bool:
    """Cheap pre-check for `find_bad_text`: a \\uD800-\\uDFFF escape or an undecodable byte."""
    if _SURROGATE_ESCAPE.search(raw):
        return True
    return not text.isascii() and bool(_SURROGATE.search(text))  # isascii() is O(1) on str


def find_bad_text(value: Any, path: str = "") -> tuple[str, str] | None:
    """(field path, problem) of the first string (or key) in parsed JSON that is not valid
    Unicode: a lone UTF-16 surrogate (JSON allows the escape "\\ud800") or a byte that was
    not UTF-8. Tokenizers and templates cannot take such text."""
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        if m is None:
            return None
        ch = m.group()
        what = (f"a byte that is not UTF-8 (0x{ord(ch) - 0xDC00:02x})" if 0xDC80 <= ord(ch) <= 0xDCFF
                else f"a lone UTF-16 surrogate ({ch.encode('unicode_escape').decode()})")
        return path or "(body)", f"contains {what} at character {m.start()}, which is not valid text; send UTF-8"
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if _SURROGATE.search(k):
                return (path or "(body)"), "has a key that is not valid Unicode text (a lone UTF-16 surrogate)"
            found = find_bad_text(v, sub)
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, (str, list, dict)):
                found = find_bad_text(v, f"{path}[{i}]")
                if found:
                    return found
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ---- shared pieces -------------------------------------------------------------------------

class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(VLLMSamplingFields, _Strict):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (with vLLM's extra
    ones, kiln.runtime.serving.vllm_compat).

    A request's own fields that the server does not know are accepted, as vLLM accepts them,
    and logged once (`UnknownFieldLog`); the nested objects (messages, tools, ...) stay strict,
    so a typo inside them is still a 400 naming it.
    """

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted for compatibility; Kiln has no per-token bias or billing tiers.
    service_tier: str | None = None

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v < 1 or v > 128:
            raise ValueError("n must be between 1 and 128")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return v


# ---- /v1/completions -----------------------------------------------------------------------

class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("each token-id prompt must be non-empty")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}")
        return v


# ---- /v1/chat/completions ------------------------------------------------------------------

class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURLPart(_Strict):
    type: Literal["image_url"]
    image_url: dict[str, Any]


ContentPart = Annotated[Union[TextContentPart, ImageURLPart], Field(discriminator="type")]


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallParam(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Strict):
    role: Literal["system"]
    content: str | list[TextContentPart]
    name: str | None = None


class DeveloperMessage(_Strict):
    role: Literal["developer"]
    content: str | list[TextContentPart]
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: str | list[ContentPart]
    name: str | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    refusal: str | None = None
    # An earlier reply's reasoning, as this server returns it (vLLM's names; templates that
    # keep it, Qwen3's and GPT-OSS's, see it as `reasoning_content` and `thinking`).
    reasoning_content: str | None = None
    reasoning: str | None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: str | list[TextContentPart]
    tool_call_id: str


ChatMessage = Annotated[
    Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage],
    Field(discriminator="role"),
]


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _FUNCTION_NAME.match(v):
            raise ValueError("function names are 1-64 characters of a-z, A-Z, 0-9, _ and -")
        return v

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError("function parameters must be a JSON schema of type 'object'")
        return v


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaSpec(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM-compatible extensions.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # With --reasoning-parser: whether the reply's reasoning is returned (vLLM's field), and
    # OpenAI's effort level, passed to the chat template (GPT-OSS's reads it).
    include_reasoning: bool = True
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # A client's own chat template: refused unless the server allows it
    # (--allow-client-chat-template), then rendered in a sandboxed child process.
    chat_template: str | None = None
    logit_bias: dict[str, float] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[Any]) -> list[Any]:
        if not v:
            raise ValueError("messages must contain at least one message")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        if v:
            names = [t.function.name for t in v]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"function names must be unique; repeated: {', '.join(dupes)}")
        return v
