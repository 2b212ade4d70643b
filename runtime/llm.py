"""`LLM`: the offline API. Builds an engine, queues prompts, steps until all are done."""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence as Seq

from kiln.runtime.config import EngineConfig

from kiln.runtime.engine import LLMEngine
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams

Prompt = str | list[int]
Params = SamplingParams | dict[str, Any]
Conversation = list[dict[str, Any]]


class GenerateError(ValueError):
    """Some prompts of a `generate` / `chat` call were invalid; the others ran.

    `errors` maps each failed prompt's index to its message (which names the field);
    `outputs` holds the finished outputs in prompt order, None at the failed indices.
    """

    def __init__(self, errors: dict[int, str], outputs: list[RequestOutput | None]):
        self.errors = errors
        self.outputs = outputs
        lines = [f"prompt {i}: {msg}" for i, msg in sorted(errors.items())]
        done = sum(o is not None for o in outputs)
        super().__init__(f"{len(errors)} of {len(outputs)} prompts were invalid "
                         f"({done} others finished; see .outputs):\n  " + "\n  ".join(lines))


class LLM:
    """Offline generation: `LLM(model, **options)` with the options of `EngineConfig`
    (kiln.runtime.config), e.g. `max_num_seqs`, `num_kv_blocks` (overrides the memory-derived
    KV-cache size), `cache_dir` / `require_cache` / `compile` (the compile cache)."""

    def __init__(self, model: str | None = None, **options: Any):
        self.engine = LLMEngine(EngineConfig.from_options(model, **options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    # ---- generation --------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: Params | Seq[Params] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt together (continuous batching); results in prompt order.

        `prompts` is one prompt or a list of them; a prompt is a string or a list of token
        ids. `sampling_params` is one SamplingParams (or dict) for all, or one per prompt.

        A bad prompt fails alone: every prompt is validated on its own, the valid ones run
        to completion, and then, if any was invalid, `GenerateError` (a ValueError) is raised
        naming each bad prompt's index and field, with the finished outputs in `.outputs`.
        """
        prompts, params = self._normalize(prompts, sampling_params)
        return self._run(prompts, params)

    def _run(self, prompts: list[Prompt | ValueError], params: list[Params]) -> list[RequestOutput]:
        """Queue every valid prompt, step until they finish, then raise for the invalid ones."""
        ids: list[str | None] = []
        errors: dict[int, str] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = f"gen-{next(self._ids)}"
            try:
                if isinstance(prompt, ValueError):
                    raise prompt
                self.engine.add_request(rid, prompt, p, every_step=False)  # only final outputs are kept
                ids.append(rid)
            except ValueError as e:
                errors[i] = str(e)
                ids.append(None)
        finished: dict[str, RequestOutput] = {}
        pending = {rid for rid in ids if rid is not None}
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        finished[out.request_id] = out
                        pending.discard(out.request_id)
        finally:
            for rid in pending:  # only on an exception (e.g. KeyboardInterrupt)
                self.engine.abort(rid)
        outputs = [finished[rid] if rid is not None else None for rid in ids]
        if errors:
            raise GenerateError(errors, outputs)
        return outputs  # type: ignore[return-value]

    def stream(self, prompt: Prompt, sampling_params: Params | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it.

        Each output's completions carry `text_delta` / `token_ids_delta`: what is new since
        the previous one. Closing the iterator early aborts the request.
        """
        rid = f"gen-{next(self._ids)}"
        self.engine.add_request(rid, prompt, sampling_params)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.engine.abort(rid)

    # ---- chat ---------------------------------------------------------------------------
    def chat(self, messages: Conversation | list[Conversation], sampling_params: Params | Seq[Params] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Replies to one conversation or a list of them, with the tokenizer's chat template.

        A conversation is a list of {"role": ..., "content": ...} messages. Errors behave as
        in `generate` (a malformed conversation fails alone).
        """
        is_one = isinstance(messages, list) and (not messages or isinstance(messages[0], dict))
        conversations = [messages] if is_one else list(messages)
        prompts: list[Prompt | ValueError] = []
        for conv in conversations:
            try:
                prompts.append(self.apply_chat_template(conv, tools=tools))
            except ValueError as e:
                prompts.append(e)
        _, params = self._normalize(prompts, sampling_params, one_prompt=False)
        return self._run(prompts, params)

    def apply_chat_template(self, conversation: Conversation, tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `conversation` rendered with the tokenizer's chat template."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("messages: this model has no chat template; use generate() with a plain prompt")
        if not isinstance(conversation, list) or not conversation:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for j, m in enumerate(conversation):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{j}] must be a dict with a string 'role', got {m!r}")
            if "content" in m and m["content"] is not None and not isinstance(m["content"], (str, list)):
                raise ValueError(f"messages[{j}].content must be a string, got {type(m['content']).__name__}")
        ids = tok.apply_chat_template(conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                                      tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    # ---- helpers -----------------------------------------------------------------------
    @staticmethod
    def _normalize(prompts: Any, params: Any, one_prompt: bool = True) -> tuple[list[Any], list[Params]]:
        """Prompts as a list, and one sampling-params entry per prompt.

        With `one_prompt`, a string or a flat list of ints is taken as a single prompt.
        """
        one_token_list = (isinstance(prompts, (list, tuple)) and len(prompts) > 0
                          and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts))
        if one_prompt and (isinstance(prompts, str) or one_token_list):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, (SamplingParams, dict)):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(prompts)} prompts but {len(params)} sampling params")
        return prompts, params
