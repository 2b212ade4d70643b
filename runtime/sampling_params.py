"""`SamplingParams`: how one request is decoded. Validated at construction.

Every check raises `ValueError` whose message starts with the field's name, so a caller (the
HTTP server, the CLI, `LLM.generate`) can hand it back to the user as it is.
`SamplingParams.from_dict` builds one from untyped input (JSON) and rejects unknown keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

# How many top alternatives a request may ask for per generated token (OpenAI allows 20).
MAX_LOGPROBS = 20


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


@dataclass
class StructuredOutputs:
    """A constraint on the output (exactly one field set): `json` a JSON schema (a dict or
    its JSON text; True for any JSON value), `regex` a regular expression, `choice` one of
    these strings, `grammar` an EBNF grammar (xgrammar's dialect, with a `root` rule)."""

    json: dict[str, Any] | str | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_fields = [f.name for f in fields(self) if getattr(self, f.name) is not None]
        if len(set_fields) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar; "
                             f"got {', '.join(set_fields) or 'none'}")
        if self.json is not None and not (isinstance(self.json, (dict, str)) or self.json is True):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, its JSON text, or true; "
                             f"got {self.json!r}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty EBNF string, got {self.grammar!r}")


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """`token_ids`' last `keep` tokens (-1: `max_model_len`; None: all of them), as vLLM's
    `truncate_prompt_tokens` keeps them."""
    if keep == -1:
        keep = max_model_len
    if keep is None or keep < 1 or len(token_ids) <= keep:
        return token_ids
    return token_ids[-keep:]


@dataclass
class SamplingParams:
    """Decoding options of one request.

    temperature 0 means greedy (top_k/top_p/min_p/seed are then irrelevant).
    Penalties follow the usual conventions: `repetition_penalty` (> 1 discourages) divides
    positive / multiplies negative logits of every token seen in the prompt or the output;
    `presence_penalty` is subtracted once from tokens already in the output and
    `frequency_penalty` once per occurrence there (OpenAI semantics).
    `logprobs=N` returns, per generated token, its own logprob plus the N most likely.
    `stop` strings end generation and are not part of the returned text (unless
    `include_stop_str_in_output`); `stop_token_ids` end it like EOS does.
    `logit_bias` adds a value in [-100, 100] to a token's logit; `allowed_token_ids` keeps only
    those tokens; `bad_words` are never generated (a word's last token is masked whenever the
    output ends with its other tokens, written with and without a leading space, as vLLM does).
    `top_k` 0 or -1 means off (vLLM's convention). `prompt_logprobs=N` returns, per prompt
    token after the first, its logprob plus the N most likely (the engine refuses it when it
    runs compiled buckets, whose number of logits rows is fixed; see LLMEngine.validate_request). `min_tokens` forbids EOS / stop tokens (and ignores stop strings)
    until that many tokens exist; `ignore_eos` keeps going past EOS. `structured_outputs`
    constrains the output to a JSON schema, regex, choice or grammar (a `StructuredOutputs`
    or a dict of its fields). `truncate_prompt_tokens=k` keeps only the prompt's last k tokens
    (-1: the engine's max_model_len), as vLLM's does (`truncated_prompt`). `detokenize=False`
    returns token ids without text (no detokenizing, as vLLM's; stop strings need the text).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            unknown = sorted(set(self.structured_outputs) - {f.name for f in fields(StructuredOutputs)})
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)}; "
                                 "use json, regex, choice or grammar")
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs or a dict, "
                             f"got {type(self.structured_outputs).__name__}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.logit_bias, dict):
            # JSON object keys are strings: "50256": -100 means token 50256.
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {list(self.logit_bias)[:5]!r}") from None
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.validate()

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from untyped input (e.g. a JSON body); unknown keys are an error naming them."""
        if not isinstance(values, dict):
            raise ValueError(f"sampling params must be a mapping of field -> value, got {type(values).__name__}")
        known = set(cls.field_names())
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.field_names()}

    def validate(self) -> None:
        def bad(field_name: str, why: str) -> ValueError:
            return ValueError(f"{field_name} {why}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", f"must be 0 or -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be a number > 0 (1 = off), got {self.repetition_penalty!r}")
        if not _is_number(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be a number in [-2, 2], got {self.presence_penalty!r}")
        if not _is_number(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be a number in [-2, 2], got {self.frequency_penalty!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", f"must be an integer or None, got {self.seed!r}")
        if not _is_int(self.n) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", f"must be a string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad("skip_special_tokens", f"must be true or false, got {self.skip_special_tokens!r}")
        if self.logit_bias is not None and (
                not isinstance(self.logit_bias, dict)
                or any(not _is_int(t) or t < 0 or not _is_number(v) or not -100 <= v <= 100
                       for t, v in self.logit_bias.items())):
            raise bad("logit_bias", f"must map token ids (integers >= 0) to numbers in [-100, 100], "
                                    f"got {self.logit_bias!r}")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", f"must be a non-empty list of token ids (integers >= 0), "
                                           f"got {self.allowed_token_ids!r}")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", f"must be a list of non-empty strings, got {self.bad_words!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise bad("include_stop_str_in_output", f"must be true or false, got {self.include_stop_str_in_output!r}")
        if self.prompt_logprobs is not None and not (_is_int(self.prompt_logprobs)
                                                     and 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None, "
                                         f"got {self.prompt_logprobs!r}")
        if self.truncate_prompt_tokens is not None and not (
                _is_int(self.truncate_prompt_tokens)
                and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)):
            raise bad("truncate_prompt_tokens", f"must be an integer >= 1, -1 (the engine's max_model_len) or None, "
                                                f"got {self.truncate_prompt_tokens!r}")
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", f"must be true or false, got {self.detokenize!r}")
        if self.stop and not self.detokenize:
            raise bad("stop", "strings are matched in the output text, which detokenize=False does not make; "
                              "use stop_token_ids, or detokenize=True")

    def truncated_prompt(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt this request runs (`truncate_prompt`)."""
        return truncate_prompt(token_ids, self.truncate_prompt_tokens, max_model_len)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_token_masks(self) -> bool:
        """logit_bias / allowed_token_ids / bad_words: applied with the penalties (step 1)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)


# vLLM's name (vllm.sampling_params.StructuredOutputsParams).
StructuredOutputsParams = StructuredOutputs
