"""`LLM`: the offline API. Builds an engine, queues prompts, steps until all are done."""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence as Seq

from kiln.runtime.engine import EngineConfig, LLMEngine
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        load_format: str = "auto",
        enable_passes: list[str] | None = None,
        disable_passes: list[str] | None = None,
        progress: bool = True,
    ):
        self.engine = LLMEngine(EngineConfig(
            model=str(model) if model is not None else None, dtype=dtype, device=device,
            max_model_len=max_model_len, block_size=block_size, num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, load_format=load_format,
            enable_passes=list(enable_passes or []), disable_passes=list(disable_passes or []),
            progress=progress,
        ))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def _normalize(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None
                   ) -> tuple[list[Prompt], list[SamplingParams]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        return prompts, params

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt together (continuous batching); results in prompt order."""
        prompts, params = self._normalize(prompts, sampling_params)
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"gen-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[rid] for rid in ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (for terminals)."""
        rid = f"gen-{next(self._ids)}"
        self.engine.add_request(rid, prompt, sampling_params or SamplingParams())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        ids = tok.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
