"""Guided (constrained) decoding: masks the logits so the output follows a grammar.

The engine owns it (kiln.runtime.engine): a request whose SamplingParams carry
`structured_outputs` (JSON schema, regex, choice or EBNF grammar), or that the server hands a
compiled grammar (tool calls, response_format), has its rows of the logits masked before
every draw, so `LLM.generate` and the server constrain output the same way. Built on
xgrammar (grammar compiler and per-sequence token-mask matcher). What the server compiles:

- `tool_choice` naming a function: the reply must be exactly one Hermes-style call of that
  function, `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`, with ARGS
  following the function's JSON schema; then the end-of-sequence token.
- `tool_choice: "required"`: the same, for any one of the tools.
- `tool_choice: "auto"`: free text, but once the model writes `<tool_call>` the call must be
  well formed (one of the tools, arguments valid for its schema). So a small model that
  starts a call cannot produce a broken one.
- `response_format` `json_object` / `json_schema`: the reply is JSON (following the schema).

With a reasoning parser (`kiln serve --reasoning-parser`) the server wraps any of these in
`AfterMarker`: the grammar holds only after the reasoning's end marker (`</think>`, harmony's
final channel), so the model thinks freely first.

`GrammarMasker` is the engine's logits processor: before each draw it advances every guided
sequence's matcher by the tokens sampled since, and masks the rows of the logits that belong
to guided sequences. Unguided rows are left untouched, so a batch mixes both freely. All its
methods run on the engine thread.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("kiln.runtime.guided")

TOOL_CALL_PREFIX = '<tool_call>\n{{"name": {name}, "arguments": '
TOOL_CALL_SUFFIX = "}\n</tool_call>"
MISTRAL_CALL_PREFIX = '[TOOL_CALLS][{{"name": {name}, "arguments": '
MISTRAL_CALL_SUFFIX = "}]"
# Whitespace between JSON tokens is capped: a small model left free to emit whitespace can
# spend its whole token budget on newlines inside an unfinished object.
MAX_JSON_WHITESPACE = 2


class GrammarError(ValueError):
    """A schema the grammar compiler cannot use; `param` names the request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class ToolSchema:
    name: str
    parameters: dict[str, Any]
    param: str  # the request field this schema came from, for error messages


class GrammarCompiler:
    """Compiles request grammars against one tokenizer (built lazily: the first guided
    request pays ~0.2 s to index the vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()  # compile calls come from the server's worker threads

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                if self._tokenizer is None:
                    raise GrammarError("this model has no tokenizer, so its output cannot be constrained")
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def tool_calls(self, tools: list[ToolSchema], mode: str, parallel: bool = True, parser: str = "hermes") -> Any:
        """mode: 'named' (exactly one call of tools[0]), 'required' (one call of any tool)
        or 'auto' (free text; any call the model starts must be a valid one; with `parallel`
        False, generation stops after the first call). `parser` is the model family's call
        format (kiln.runtime.serving.tool_parser): hermes and mistral are built here,
        llama3_json, qwen3_coder and openai (harmony) come from xgrammar's built-in structural tags."""
        from xgrammar.structural_tag import (JSONSchemaFormat, OrFormat, StructuralTag, TagFormat,
                                             TriggeredTagsFormat)

        for tool in tools:
            self._check_schema(tool.parameters, tool.param)
        builtin = {"llama3_json": "llama", "qwen3_coder": "qwen_3_coder", "openai": "harmony"}.get(parser)
        if builtin is not None:
            return self._compile(lambda c: c.compile_structural_tag(self._builtin_tag(builtin, tools, mode, parallel)),
                                 "tools")
        begin, end, trigger = TOOL_CALL_PREFIX, TOOL_CALL_SUFFIX, "<tool_call>"
        if parser == "mistral":
            begin, end, trigger = MISTRAL_CALL_PREFIX, MISTRAL_CALL_SUFFIX, "[TOOL_CALLS]"
        elif parser != "hermes":
            raise GrammarError(f"no tool-call grammar for parser {parser!r}", "tools")
        tags = [
            TagFormat(begin=begin.format(name=json.dumps(t.name)),
                      content=JSONSchemaFormat(json_schema=t.parameters, max_whitespace_cnt=MAX_JSON_WHITESPACE),
                      end=end)
            for t in tools
        ]
        if mode == "auto":
            fmt: Any = TriggeredTagsFormat(triggers=[trigger], tags=tags, stop_after_first=not parallel)
        elif len(tags) == 1:
            fmt = tags[0]
        else:
            fmt = OrFormat(elements=tags)
        return self._compile(lambda c: c.compile_structural_tag(StructuralTag(format=fmt)), "tools")

    @staticmethod
    def _builtin_tag(model: str, tools: list[ToolSchema], mode: str, parallel: bool) -> Any:
        from xgrammar import get_builtin_structural_tag

        choice: Any = {"auto": "auto", "required": "required"}.get(mode)
        if mode == "named":
            choice = {"type": "function", "function": {"name": tools[0].name}}
        return get_builtin_structural_tag(
            model, tools=[{"type": "function", "function": {"name": t.name, "parameters": t.parameters}}
                          for t in tools],
            # GPT-OSS reasons (its analysis channel) before it calls: harmony's tag allows it.
            tool_choice=choice, reasoning="enabled" if model == "harmony" else "disabled", parallel_tool_calls=parallel,
            max_whitespace_cnt=MAX_JSON_WHITESPACE)

    def structured(self, spec: Any, param: str = "structured_outputs") -> Any:
        """The compiled grammar of a `StructuredOutputs` (kiln.runtime.sampling_params)."""
        if spec.json is not None:
            schema = None if spec.json is True else spec.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"{param}.json is not valid JSON: {e}", f"{param}.json") from None
            return self.json(schema, f"{param}.json")
        if spec.regex is not None:
            return self._compile(lambda c: c.compile_regex(spec.regex), f"{param}.regex")
        if spec.choice is not None:
            # One alternative per choice, each matched literally.
            ebnf = "root ::= " + " | ".join(json.dumps(c) for c in spec.choice)
            return self._compile(lambda c: c.compile_grammar(ebnf), f"{param}.choice")
        return self._compile(lambda c: c.compile_grammar(spec.grammar), f"{param}.grammar")

    def json(self, schema: dict[str, Any] | None, param: str) -> Any:
        """Any JSON value when schema is None (response_format json_object), else the schema."""
        if schema is None:
            return self._compile(lambda c: c.compile_builtin_json_grammar(), param)
        self._check_schema(schema, param)
        return self._compile(lambda c: c.compile_json_schema(json.dumps(schema), any_whitespace=False), param)

    def _check_schema(self, schema: Any, param: str) -> None:
        if not isinstance(schema, dict):
            raise GrammarError(f"{param} must be a JSON schema object, got {type(schema).__name__}", param)
        try:
            self._get().compile_json_schema(json.dumps(schema), any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{param} is not a usable JSON schema: {_short(e)}", param) from None

    def _compile(self, fn: Any, param: str) -> Any:
        compiler = self._get()
        try:
            return fn(compiler)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{param}: cannot build an output grammar: {_short(e)}", param) from None


def _short(e: Exception) -> str:
    # xgrammar's C++ errors start with a timestamp and source location; keep the message.
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "] " in text and text.startswith("["):
        text = text.split("] ", 1)[1]
    if ": " in text and ".cc:" in text:
        text = text.split(": ", 1)[1]
    return text


@dataclass(frozen=True)
class AfterMarker:
    """A compiled grammar that constrains only the output after `marker` (token ids): a
    reasoning model thinks freely first, and the grammar holds its answer (the server wraps a
    request's grammar in one when it runs with `--reasoning-parser`,
    kiln.runtime.serving.reasoning_parser).
    Until the marker is written, the sequence's rows are not masked."""

    grammar: Any
    marker: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.marker:
            raise ValueError("AfterMarker needs a non-empty marker")


def find_token_run(tokens: list[int], run: tuple[int, ...]) -> int:
    """Index of the first occurrence of `run` in `tokens` (-1: none)."""
    n = len(run)
    for i in range(len(tokens) - n + 1):
        if tokens[i] == run[0] and tuple(tokens[i:i + n]) == run:
            return i
    return -1


class _SequenceMatcher:
    def __init__(self, compiled: Any, stop_token_ids: list[int]):
        import xgrammar as xgr

        self.waiting_for: tuple[int, ...] | None = None
        if isinstance(compiled, AfterMarker):
            compiled, self.waiting_for = compiled.grammar, compiled.marker
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        self.num_accepted = 0  # output tokens given to the matcher (or, while waiting, scanned)
        self.broken = False

    def reached_grammar(self, output: list[int]) -> bool:
        """Whether the grammar has started (after its marker, if it waits for one); the
        tokens up to and including the marker are never the matcher's."""
        if self.waiting_for is None:
            return True
        # Only the tokens since the last scan (and a marker's length before them) are read.
        start = max(self.num_accepted - len(self.waiting_for) + 1, 0)
        at = find_token_run(list(output[start:]), self.waiting_for)
        if at < 0:
            self.num_accepted = len(output)
            return False
        self.num_accepted, self.waiting_for = start + at + len(self.waiting_for), None
        return True


class GrammarMasker:
    """The engine's logits processor: masks guided rows of the logits before each draw."""

    def __init__(self, vocab_size: int, stop_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._grammars: dict[str, Any] = {}  # request_id -> compiled grammar
        self._matchers: dict[str, dict[int, _SequenceMatcher]] = {}  # request_id -> seq index -> matcher

    def register(self, request_id: str, compiled: Any) -> None:
        self._grammars[request_id] = compiled
        self._matchers[request_id] = {}

    def release(self, request_id: str) -> None:
        self._grammars.pop(request_id, None)
        self._matchers.pop(request_id, None)

    @property
    def num_guided(self) -> int:
        return len(self._grammars)

    def guides(self, seqs: list[Any]) -> bool:
        """Whether any of `seqs` is guided. A guided row's mask follows the grammar from every
        earlier token, so its next step cannot be launched before its token is read back."""
        return bool(self._grammars) and any(seq.request_id in self._grammars for seq in seqs)

    def apply(self, logits: torch.Tensor, seqs: list[Any]) -> None:
        """Mask (in place) the rows of `logits` whose sequences are guided; row i is seqs[i]."""
        if not self._grammars:
            return
        import xgrammar as xgr

        rows: list[int] = []
        matchers: list[_SequenceMatcher] = []
        for row, seq in enumerate(seqs):
            compiled = self._grammars.get(seq.request_id)
            if compiled is None:
                continue
            per_request = self._matchers[seq.request_id]
            m = per_request.get(seq.index)
            if m is None:
                m = per_request[seq.index] = _SequenceMatcher(compiled, self.stop_token_ids)
            if m.broken or not m.reached_grammar(seq.output_token_ids):
                continue
            for token in seq.output_token_ids[m.num_accepted:]:
                if not m.matcher.accept_token(int(token)):
                    # Cannot happen while every sampled row is masked; if it does, stop
                    # guiding this sequence rather than fail it (the parser falls back).
                    logger.warning("request %s: sampled token %d breaks its grammar; no longer guided",
                                   seq.request_id, token)
                    m.broken = True
                    break
                m.num_accepted += 1
            if m.broken or m.matcher.is_terminated():
                continue
            rows.append(row)
            matchers.append(m)
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(seqs), self.vocab_size)
        for row, m in zip(rows, matchers):
            m.matcher.fill_next_token_bitmask(bitmask, row)
        width = min(logits.shape[-1], self.vocab_size)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=width, indices=rows)
        if logits.shape[-1] > width:  # padded vocabulary rows the tokenizer never produces
            logits[rows, width:] = float("-inf")
