"""What generation returns: one `RequestOutput` per prompt, with n `CompletionOutput`s.

Streaming: each `RequestOutput` the engine hands out carries, per completion, the full
state so far (`text`, `token_ids`, `logprobs`) and what is new since the previous output
of the same request (`text_delta`, `token_ids_delta`, `logprobs_delta`). Concatenating the
deltas gives the full values; a consumer that streams never has to re-decode anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    token_id: int
    logprob: float


@dataclass
class TokenLogprobs:
    """Logprobs of one generated token.

    Computed by the sampler from the log-softmax of the logits it sampled from, after
    repetition/presence/frequency penalties and the min_tokens mask, before temperature and
    top-k/top-p/min-p (see `kiln.runtime.sampler`).
    """

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[Logprob] = field(default_factory=list)  # the N most likely, most likely first


@dataclass
class CompletionOutput:
    index: int
    text: str  # the text so far (stop strings cut off; held back while one may be forming)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id; None for EOS
    logprobs: list[TokenLogprobs] | None = None  # when the request asked for them
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request timings, in seconds (monotonic clock)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    time_in_queue: float | None = None  # arrival -> first scheduled
    time_to_first_token: float | None = None  # arrival -> first generated token
    # (last token time - first token time) / (tokens - 1), over the longest completion.
    time_per_output_token: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    # Prompt tokens whose K/V came from the prefix cache (first completion, last admission).
    num_cached_tokens: int = 0
