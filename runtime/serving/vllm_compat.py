"""What the server takes from vLLM's API beyond OpenAI's: the extra request fields, the
structured-output forms (`structured_outputs` and the older `guided_*`), the tolerance for
fields it does not know, and the bodies of `/tokenize` and `/detokenize`.

vLLM accepts a request field it does not know and logs it (clients add provider-specific
fields freely); Kiln does the same, logging each unknown field name once per server, so a
client that sends one on every request does not flood the log.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from kiln.runtime.sampling_params import StructuredOutputs

logger = logging.getLogger("kiln.serving")

# guided_* field -> StructuredOutputs field (vLLM's older names for the same constraints).
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class VLLMSamplingFields(BaseModel):
    """vLLM's extra sampling fields, shared by /v1/completions and /v1/chat/completions
    (OpenAI's own are in protocol._SamplingFields)."""

    include_stop_str_in_output: bool = False
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None

    def structured(self) -> StructuredOutputs | None:
        """The request's output constraint, from `structured_outputs` or a `guided_*` field;
        ValueError naming the fields when it gives more than one."""
        given = [name for name in ("structured_outputs", *GUIDED_FIELDS) if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[0]}: give only one of {', '.join(given)}")
        if not given:
            return None
        if given[0] == "structured_outputs":
            spec = dict(self.structured_outputs or {})
            spec.pop("disable_any_whitespace", None)  # vLLM options with no meaning here
            spec.pop("disable_fallback", None)
            unknown = sorted(set(spec) - {"json", "regex", "choice", "grammar"})
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)}; "
                                 "use json, regex, choice or grammar")
            return StructuredOutputs(**spec)
        return StructuredOutputs(**{GUIDED_FIELDS[given[0]]: getattr(self, given[0])})

    def sampling_values(self) -> dict[str, Any]:
        """The fields that map one to one onto SamplingParams."""
        values: dict[str, Any] = {"include_stop_str_in_output": self.include_stop_str_in_output}
        for name in ("prompt_logprobs", "allowed_token_ids", "bad_words", "truncate_prompt_tokens"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return values


class UnknownFieldLog:
    """Logs the request fields the server ignored, each name once (one per server)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def note(self, request: BaseModel, endpoint: str) -> None:
        extra = sorted((request.model_extra or {}).keys())
        if not extra:
            return
        with self._lock:
            new = [name for name in extra if name not in self._seen]
            self._seen.update(new)
        if new:
            logger.warning("The following fields were present in the request but ignored: %s (%s; each field "
                           "is reported once)", ", ".join(repr(n) for n in new), endpoint)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def prompt_logprobs_json(prompt_logprobs: list[Any] | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's response field: per prompt token, token id (as a JSON key) -> {logprob, rank,
    decoded_token}; None for the first token."""
    if prompt_logprobs is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in prompt_logprobs:
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": lp.logprob if lp.logprob > -1e30 else -9999.0, "rank": lp.rank,
                             "decoded_token": lp.decoded_token} for t, lp in entry.items()})
    return out


def system_fingerprint(engine: Any) -> str:
    """Stable for one server's model and settings (OpenAI's `system_fingerprint`): the Kiln
    version and a hash of what decides the outputs (architecture config, dtype, passes)."""
    import hashlib
    import json

    from kiln.runtime.version import __version__

    config = getattr(engine, "model_config", None)
    settings = {"config": config.to_dict() if hasattr(config, "to_dict") else repr(config),
                "dtype": str(getattr(engine, "dtype", "")),
                "passes": [getattr(engine.config, "enable_passes", []), getattr(engine.config, "disable_passes", [])]
                if getattr(engine, "config", None) is not None else []}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"kiln-{__version__}-{digest}"


def request_log_line(request_id: str, endpoint: str, num_prompt_tokens: list[int], params: Any,
                     guided: bool) -> str:
    """One line per request (vLLM logs each request unless --disable-log-requests)."""
    fields = {"n": params.n, "max_tokens": params.max_tokens, "temperature": params.temperature,
              "top_p": params.top_p, "top_k": params.top_k, "seed": params.seed}
    shown = ", ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    return (f"request {request_id} {endpoint}: prompt tokens {num_prompt_tokens}, {shown}"
            + (", guided" if guided else ""))


@dataclass
class ServingOptions:
    """The server options vLLM users know (`kiln serve` flags of the same names)."""

    tool_call_parser: str = "hermes"  # --tool-call-parser (kiln.runtime.serving.tool_parser)
    reasoning_parser: str | None = None  # --reasoning-parser (kiln.runtime.serving.reasoning_parser)
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice "auto" is allowed
    chat_template: str | None = None  # --chat-template: used instead of the tokenizer's
    log_requests: bool = True  # off with --disable-log-requests


def tokenize(tokenizer: Any, req: TokenizeRequest, chat_template: str | None, max_model_len: int) -> dict[str, Any]:
    """/tokenize (blocking: run it off the event loop). Messages are rendered with the
    server's chat template (--chat-template) or the model's; ValueError names the field."""
    if tokenizer is None:
        raise ValueError("model: this model has no tokenizer")
    if req.prompt is not None:
        ids = list(tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
    else:
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template (start the server with --chat-template)")
        kwargs = dict(req.chat_template_kwargs or {})
        try:
            ids = tokenizer.apply_chat_template(
                req.messages, chat_template=chat_template, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, tokenize=True, return_dict=False, **kwargs)
        except Exception as e:  # the template's own errors (jinja, raise_exception)
            raise ValueError(f"messages: the chat template failed: {type(e).__name__}: {e}") from None
        ids = list(ids)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(tokenizer: Any, req: DetokenizeRequest, vocab_size: int) -> dict[str, Any]:
    """/detokenize; ValueError naming `tokens` for ids outside the vocabulary."""
    if tokenizer is None:
        raise ValueError("model: this model has no tokenizer")
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"tokens: {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return {"prompt": tokenizer.decode(req.tokens)}
