"""Output text, built incrementally as tokens arrive.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas. Byte-level
tokenizers split multi-byte UTF-8 characters across tokens, and decoding such a prefix
yields U+FFFD; so a delta is only released once the decoded window no longer ends in
U+FFFD. Each step decodes a short window (the tokens since the last release plus the ones
before it for context, which is what makes e.g. SentencePiece's leading space right), never
the whole output.

`OutputText` holds a completion's text, cuts it at the first stop string, and holds back
the last (longest stop string - 1) characters while a stop string could still be forming,
so that text once streamed never has to be taken back.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded before the first output token, as context.
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list((prompt_token_ids or [])[-CONTEXT_TOKENS:])
        # A context that itself ends mid-character would misalign the first delta.
        if context and REPLACEMENT_CHAR in self._decode(context):
            context = []
        self.tokens: list[int] = context
        # tokens[prefix_offset:read_offset] were released already and serve as context;
        # tokens[read_offset:] are not released yet.
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._prefix_text = self._decode(context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes ("" while a character is incomplete)."""
        self.tokens.append(int(token_id))
        text = self._decode(self.tokens[self.prefix_offset:])
        if len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT_CHAR):
            return self._release(text)
        return ""

    def flush(self) -> str:
        """At the end of generation: release whatever is pending, incomplete bytes as U+FFFD."""
        if self.read_offset == len(self.tokens):
            return ""
        text = self._decode(self.tokens[self.prefix_offset:])
        return self._release(text) if len(text) > len(self._prefix_text) else ""

    def _release(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self._prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        return delta


class OutputText:
    """One completion's text: detokenized deltas in, stop strings cut, stream-safe deltas out."""

    def __init__(self, detokenizer: IncrementalDetokenizer, stop: list[str], include_stop: bool = False):
        self.detokenizer = detokenizer
        self.stop = list(stop)
        self.include_stop = include_stop  # keep the stop string at the end of the text (vLLM's option)
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.num_emitted_chars = 0
        self.stopped_by: str | None = None

    def push(self, token_id: int, check_stop: bool = True) -> str | None:
        """Decode one more token; returns the stop string if the text now contains one."""
        return self._append(self.detokenizer.push(token_id), check_stop)

    def finish(self, check_stop: bool = True) -> str | None:
        """Decode what is still pending (generation ended); returns a stop string if one completed."""
        if self.stopped_by is not None:
            return None
        return self._append(self.detokenizer.flush(), check_stop)

    def _append(self, delta: str, check_stop: bool) -> str | None:
        if not delta or self.stopped_by is not None:
            return None
        # Only matches that end inside the new delta are new.
        search_from = max(0, len(self.text) - self.hold_back)
        self.text += delta
        if not (check_stop and self.stop):
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        self.text = self.text[:best[0] + (len(best[1]) if self.include_stop else 0)]
        self.stopped_by = best[1]
        return best[1]

    def take_delta(self, final: bool) -> str:
        """Text not handed out yet; while running, the possible start of a stop string stays back."""
        end = len(self.text) if final or self.stopped_by is not None else len(self.text) - self.hold_back
        end = max(end, self.num_emitted_chars)
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return delta

    @property
    def emitted_text(self) -> str:
        return self.text[:self.num_emitted_chars]
