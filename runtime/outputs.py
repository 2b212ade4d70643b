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
    """One token's log-probability as vLLM returns it: `CompletionOutput.logprobs[i]` maps
    token id -> Logprob for the sampled token and the N most likely ones."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# vLLM's names: per position, token id -> Logprob.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class TopLogprob:
    token_id: int
    logprob: float


@dataclass
class TokenLogprobs:
    """Logprobs of one generated token, as the sampler computes them (the engine turns them
    into `dict[int, Logprob]` for the outputs).

    Computed from the log-softmax of the logits the sampler sampled from, after
    repetition/presence/frequency penalties, logit_bias, allowed_token_ids, bad_words and the
    min_tokens mask, before temperature and top-k/top-p/min-p (see `kiln.runtime.sampler`).
    """

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[TopLogprob] = field(default_factory=list)  # the N most likely, most likely first


def top_entries(token_id: int, entry: dict[int, Logprob], n: int) -> tuple[Logprob, list[tuple[int, Logprob]]]:
    """(the sampled token's Logprob, the `n` most likely entries, most likely first) of one
    position: what OpenAI's `logprobs` / `top_logprobs` are built from. (`n` is needed: the
    dict alone cannot tell a sampled token of rank n+1 from a top-n one.)"""
    top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= n),
                 key=lambda x: x[1].rank or 0)
    return entry[token_id], top[:n]


@dataclass
class CompletionOutput:
    index: int
    text: str  # the text so far (stop strings cut off; held back while one may be forming)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id; None for EOS
    # When the request asked for logprobs (vLLM's shape): per generated token, token id ->
    # Logprob for the sampled token and the `logprobs` most likely ones.
    logprobs: SampleLogprobs | None = None
    # Sum of the sampled tokens' logprobs (None unless logprobs were asked for, as in vLLM).
    cumulative_logprob: float | None = None
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: SampleLogprobs | None = None

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
    # SamplingParams.prompt_logprobs, as vLLM returns them: None for the first prompt token,
    # then token id -> Logprob for each prompt token and the N most likely there.
    prompt_logprobs: PromptLogprobs | None = None
