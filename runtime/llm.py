"""`LLM`: the offline API. Builds an engine, queues prompts, steps until all are done.

Call-compatible with vLLM's `LLM`: a prompt is a string, a list of token ids, or a
`{"prompt": ...}` / `{"prompt_token_ids": ...}` dict (vLLM's `TextPrompt` / `TokensPrompt`);
`generate` / `chat` show a progress bar unless `use_tqdm=False`.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Iterator, Sequence as Seq, TypedDict

from kiln.runtime.config import EngineConfig

from kiln.runtime.engine import LLMEngine
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams


class TextPrompt(TypedDict, total=False):
    """vLLM's text prompt: `{"prompt": "..."}`."""

    prompt: str


class TokensPrompt(TypedDict, total=False):
    """vLLM's token prompt: `{"prompt_token_ids": [...]}`."""

    prompt_token_ids: list[int]


Prompt = str | list[int]
PromptLike = str | list[int] | TextPrompt | TokensPrompt
Params = SamplingParams | dict[str, Any]
Conversation = list[dict[str, Any]]
# Keys of a prompt dict that vLLM defines and Kiln cannot honour (named in the error).
_UNSUPPORTED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "prompt_embeds", "lora_request")
# chat_template_kwargs may not replace what apply_chat_template's own arguments set.
_RESERVED_TEMPLATE_KWARGS = ("conversation", "tools", "tokenize", "add_generation_prompt", "chat_template",
                             "return_dict", "continue_final_message")


def _is_token_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in x)


def parse_prompt(prompt: Any) -> Prompt:
    """One prompt in any form vLLM accepts -> text or token ids; ValueError naming the problem."""
    if isinstance(prompt, str) or _is_token_list(prompt):
        return prompt if isinstance(prompt, str) else list(prompt)
    if isinstance(prompt, dict):
        unsupported = [k for k in _UNSUPPORTED_PROMPT_KEYS if k in prompt]
        if unsupported:
            raise ValueError(f"prompt: {', '.join(unsupported)} is not supported (Kiln runs text-only models)")
        unknown = sorted(str(k) for k in prompt if k not in ("prompt", "prompt_token_ids"))
        if unknown:
            raise ValueError(f"prompt: unknown key(s) {', '.join(unknown)}; a prompt dict has 'prompt' (text) "
                             "or 'prompt_token_ids' (a list of token ids)")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not _is_token_list(ids):
                raise ValueError(f"prompt_token_ids must be a non-empty list of integers, got {ids!r}"[:200])
            return list(ids)
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"prompt: 'prompt' must be a string, got {type(prompt['prompt']).__name__}")
            return prompt["prompt"]
        raise ValueError("prompt: a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (token ids)")
    if isinstance(prompt, (list, tuple)) and not prompt:
        raise ValueError("prompt is empty: give at least one token")
    raise ValueError(f"prompt must be a string, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'; "
                     f"got {type(prompt).__name__}")


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

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer (vLLM's name); None when the model ships none."""
        return self.engine.tokenizer

    # ---- generation --------------------------------------------------------------------
    def generate(self, prompts: PromptLike | Seq[PromptLike], sampling_params: Params | Seq[Params] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True) -> list[RequestOutput]:
        """Generate for every prompt together (continuous batching); results in prompt order.

        `prompts` is one prompt or a list of them; a prompt is a string, a list of token
        ids, or a `{"prompt": text}` / `{"prompt_token_ids": ids}` dict. `sampling_params` is
        one SamplingParams (or dict) for all, or one per prompt. `use_tqdm` shows a progress
        bar over finished prompts (or is a tqdm-like class to use instead), as in vLLM.

        A bad prompt fails alone: every prompt is validated on its own, the valid ones run
        to completion, and then, if any was invalid, `GenerateError` (a ValueError) is raised
        naming each bad prompt's index and field, with the finished outputs in `.outputs`.
        """
        prompts, params = self._normalize(prompts, sampling_params)
        return self._run(prompts, params, use_tqdm)

    def _run(self, prompts: list[Prompt | ValueError], params: list[Params],
             use_tqdm: bool | Callable[..., Any] = False) -> list[RequestOutput]:
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
        bar = _progress_bar(use_tqdm, len(pending))
        start, in_tokens, out_tokens = time.perf_counter(), 0, 0
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        finished[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            # vLLM's postfix: prompt and generated tokens per second so far.
                            in_tokens += len(out.prompt_token_ids)
                            out_tokens += sum(len(c.token_ids) for c in out.outputs)
                            elapsed = max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                                                f"output: {out_tokens / elapsed:.2f} toks/s", refresh=False)
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in pending:  # only on an exception (e.g. KeyboardInterrupt)
                self.engine.abort(rid)
        outputs = [finished[rid] if rid is not None else None for rid in ids]
        if errors:
            raise GenerateError(errors, outputs)
        return outputs  # type: ignore[return-value]

    def stream(self, prompt: PromptLike, sampling_params: Params | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it.

        Each output's completions carry `text_delta` / `token_ids_delta`: what is new since
        the previous one. Closing the iterator early aborts the request.
        """
        rid = f"gen-{next(self._ids)}"
        self.engine.add_request(rid, parse_prompt(prompt), sampling_params)
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
             use_tqdm: bool | Callable[..., Any] = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             ) -> list[RequestOutput]:
        """Replies to one conversation or a list of them, with the tokenizer's chat template
        (or `chat_template`, a Jinja template string); `chat_template_kwargs` go to the
        template (e.g. `{"enable_thinking": False}`), as in vLLM.

        A conversation is a list of {"role": ..., "content": ...} messages. Errors behave as
        in `generate` (a malformed conversation fails alone).
        """
        is_one = isinstance(messages, list) and (not messages or isinstance(messages[0], dict))
        conversations = [messages] if is_one else list(messages)
        prompts: list[Prompt | ValueError] = []
        for conv in conversations:
            try:
                prompts.append(self.apply_chat_template(
                    conv, tools=tools, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                    continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs))
            except ValueError as e:
                prompts.append(e)
        _, params = self._normalize(prompts, sampling_params, one_prompt=False)
        return self._run(prompts, params, use_tqdm)

    def apply_chat_template(self, conversation: Conversation, tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, chat_template: str | None = None,
                            continue_final_message: bool = False,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of `conversation` rendered with the tokenizer's chat template (or `chat_template`)."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError("messages: this model has no tokenizer; use generate() with token ids")
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
            raise ValueError("chat_template must be a non-empty Jinja template string")
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("messages: this model has no chat template; pass chat_template= or use generate()")
        extra = dict(chat_template_kwargs or {})
        if not isinstance(chat_template_kwargs or {}, dict) or any(not isinstance(k, str) for k in extra):
            raise ValueError("chat_template_kwargs must be a dict with string keys")
        reserved = [k for k in extra if k in _RESERVED_TEMPLATE_KWARGS]
        if reserved:
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} is set by chat()'s own arguments")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if not isinstance(conversation, list) or not conversation:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for j, m in enumerate(conversation):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{j}] must be a dict with a string 'role', got {m!r}")
            if "content" in m and m["content"] is not None and not isinstance(m["content"], (str, list)):
                raise ValueError(f"messages[{j}].content must be a string, got {type(m['content']).__name__}")
        try:
            ids = tok.apply_chat_template(conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message, tokenize=True,
                                          chat_template=chat_template, **extra)
        except Exception as e:  # a template's own error (jinja's TemplateError, raise_exception)
            if isinstance(e, ValueError) and "chat_template" not in str(e).lower():
                raise ValueError(f"messages: {e}") from e
            raise ValueError(f"chat_template: rendering failed: {e}") from e
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    # ---- helpers -----------------------------------------------------------------------
    @staticmethod
    def _normalize(prompts: Any, params: Any, one_prompt: bool = True) -> tuple[list[Any], list[Params]]:
        """Prompts as a list, and one sampling-params entry per prompt.

        With `one_prompt`, a string or a flat list of ints is taken as a single prompt.
        """
        if one_prompt and (isinstance(prompts, (str, dict)) or _is_token_list(prompts)):
            prompts = [prompts]  # one prompt
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a prompt or a list of prompts (strings, token-id lists, "
                            f"{{'prompt': ...}} or {{'prompt_token_ids': ...}} dicts), got {type(prompts).__name__}")
        if one_prompt:
            parsed: list[Any] = []
            for p in prompts:
                try:
                    parsed.append(parse_prompt(p))
                except ValueError as e:
                    parsed.append(e)  # fails alone, reported with its index (GenerateError)
            prompts = parsed
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, (SamplingParams, dict)):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(prompts)} prompts but {len(params)} sampling params")
        return prompts, params


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int) -> Any:
    """vLLM's "Processed prompts" bar (on stderr), or None."""
    if not use_tqdm or total == 0:
        return None
    if callable(use_tqdm) and use_tqdm is not True:
        return use_tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
