"""One sequence being generated: its tokens, its KV blocks, its state, its text and timings.

A request with `n` completions has `n` sequences; they share the prompt's full KV blocks
(the scheduler forks them from the first one, `fork_parent`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kiln.runtime.detokenizer import OutputText
    from kiln.runtime.outputs import Logprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# eq=False: sequences are compared by identity (the queues hold them, `in` must not compare
# token lists).
@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # which of the request's n completions
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V are in the cache; the next step computes from here.
    num_computed_tokens: int = 0
    # Tokens sampled on the device but not yet read back and appended (async scheduling:
    # at most 1 while a continuation step that consumes it is in flight).
    num_inflight_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Its row in the recurrent layers' state caches while it holds blocks (0: none; models
    # without recurrent layers never give one).
    state_slot: int = 0
    # Hash chain over the full blocks of `all_token_ids` (filled lazily by the block manager;
    # stays valid across preemption because tokens are only ever appended).
    block_hashes: list[bytes] = field(default_factory=list)
    # Full blocks of block_table already offered to the prefix cache.
    num_committed_blocks: int = 0
    # Prompt tokens whose K/V came from the prefix cache at the last admission.
    num_cached_tokens: int = 0
    # n > 1: the sibling whose prompt blocks this one will share (cleared once admitted).
    fork_parent: "Sequence | None" = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id; None for EOS
    # Per generated token when the request asked for logprobs (vLLM's shape), and their sum.
    logprobs: list[dict[int, "Logprob"]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # SamplingParams.prompt_logprobs: prompt position -> token id -> Logprob (positions >= 1).
    prompt_logprobs: dict[int, dict[int, "Logprob"]] = field(default_factory=dict)
    # SamplingParams.bad_words as token sequences (the engine tokenizes them at admission).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Output text state (None when the model has no tokenizer).
    text: "OutputText | None" = None
    # What the last RequestOutput already carried (its deltas start here).
    num_emitted_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self._all_token_ids: list[int] = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. The list is the sequence's own: read it, do not mutate it."""
        if len(self._all_token_ids) != len(self.prompt_token_ids) + len(self.output_token_ids):
            # Someone appended to output_token_ids directly instead of append_token().
            self._all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        return self._all_token_ids

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens drawn so far, those still on the device (async scheduling) included:
        what the output length will be once they are read back."""
        return len(self.output_token_ids) + self.num_inflight_tokens

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
