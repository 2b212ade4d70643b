"""The bucket plan: the few static step shapes Kiln compiles, and which one a step runs in.

A step is `T` packed tokens from `B` sequences. Compiling one artifact per exact (T, B)
would never end, so steps are padded up to a bucket:

- **decode buckets** (`decode-N`): steps in which every sequence brings one token
  (T == B). N sequences; the default sizes are 1, 2, 4, 8, every 16 up to 256, every 64 up
  to 512, then every 128 up to 1,024 (or `max_num_seqs` if smaller). Each is an artifact
  and, on CUDA, a captured graph, so their number is bounded (28) whatever `max_num_seqs`
  is; decodes of more sequences run in a token bucket. vLLM captures up to 512; Kiln goes
  to 1,024, the default `max_num_seqs` of a large GPU, because a decode step of ~1,000
  sequences run eagerly is bound by the host's launches when its kernels are short (FP8:
  bench/RESULTS.md, J1-J2).
- **token buckets** (`tokens-N`): every other step (prefills, prefill chunks mixed with
  decodes). N tokens from at most min(N - 1, max_num_seqs) sequences (one row fewer than
  tokens: see below); the default sizes are the powers of two from 16 up to
  `max_num_batched_tokens` (which is always included).
- **mixed-graph buckets** (`mixed-N`): no artifact of their own, only a captured CUDA graph
  of the post-pass graph (kiln.runtime.model_runner) for steps of at most N tokens that are
  no decode: N tokens from at most min(N - 1, max_num_seqs) sequences, as a token bucket
  (but the largest, below) has.

Why N - 1 rows: a step that is no decode has a chunk of two or more tokens, so fewer
sequences than tokens; a padded shape with as many rows as tokens looks like a decode to the
attention launcher (kiln.kernels.triton_paged_attention routes `tokens <= sequences` to the
keys-as-rows decode kernel, which takes a chunk's tokens one at a time: correct, and slow for
a prompt), so its rows stop one short. The plan's largest token bucket is the exception: every
step must fit it, a decode that fills the whole token budget included (when the decode buckets
stop short of it), so it keeps min(N, max_num_seqs) rows.

Each bucket fixes the shapes of every batch input: input_ids/position_ids/slot_mapping
[T], seq_lens [B], query_start_loc [B+1], logits_indices [S] with S = B (a step samples at
most one row per sequence). The block-table width and the number of KV blocks are left
dynamic in the artifacts (see kiln.compiler.inductor_compile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

DECODE = "decode"
TOKENS = "tokens"
MIXED = "mixed"
SMALLEST_TOKEN_BUCKET = 16
SMALLEST_MIXED_GRAPH = 64
# Default decode buckets: every 16 sequences up to DENSE_DECODE_LIMIT, every 64 up to
# MEDIUM_DECODE_LIMIT, every 128 beyond, none above MAX_DEFAULT_DECODE_BUCKET (28 at the most).
DENSE_DECODE_LIMIT = 256
MEDIUM_DECODE_LIMIT = 512
MAX_DEFAULT_DECODE_BUCKET = 1024


class BucketPlanError(ValueError):
    """A bucket plan that cannot serve the engine's limits; the message says what to change."""


@dataclass(frozen=True, order=True)
class Bucket:
    """One static step shape: `num_tokens` tokens, `num_seqs` sequence rows, `num_samples` logits rows."""

    kind: str
    num_tokens: int
    num_seqs: int
    num_samples: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.num_seqs if self.kind == DECODE else self.num_tokens}"

    def shape(self) -> dict[str, int | str]:
        """The fields that identify the bucket in a cache key."""
        return {"kind": self.kind, "tokens": self.num_tokens, "seqs": self.num_seqs, "samples": self.num_samples}

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        if self.kind == DECODE and num_tokens != num_seqs:
            return False
        if self.kind == MIXED and num_tokens == num_seqs:
            return False  # a decode-shaped step: a decode bucket's
        return num_tokens <= self.num_tokens and num_seqs <= self.num_seqs

    def __str__(self) -> str:
        return self.name


def decode_bucket(num_seqs: int) -> Bucket:
    return Bucket(DECODE, num_seqs, num_seqs, num_seqs)


def _step_rows(num_tokens: int, max_num_seqs: int) -> int:
    """Sequence (and sampled) rows of a bucket for steps that are no decode: one fewer than
    its tokens (the module's doc says why), at most `max_num_seqs`, at least one."""
    return max(1, min(num_tokens - 1, max_num_seqs))


def token_bucket(num_tokens: int, max_num_seqs: int, holds_any_step: bool = False) -> Bucket:
    """`holds_any_step`: the plan's largest token bucket (`max_num_batched_tokens` tokens),
    the last resort of every step, so as many rows as a step may have: a decode that fills
    the token budget finds no other bucket when the decode buckets stop short of it."""
    rows = min(num_tokens, max_num_seqs) if holds_any_step else _step_rows(num_tokens, max_num_seqs)
    return Bucket(TOKENS, num_tokens, rows, rows)


def mixed_bucket(num_tokens: int, max_num_seqs: int) -> Bucket:
    rows = _step_rows(num_tokens, max_num_seqs)
    return Bucket(MIXED, num_tokens, rows, rows)


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """Token counts of the mixed-step CUDA graphs up to `max_tokens`: the powers of two from
    SMALLEST_MIXED_GRAPH, and `max_tokens` itself (none below the smallest)."""
    sizes = []
    n = SMALLEST_MIXED_GRAPH
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    if max_tokens >= SMALLEST_MIXED_GRAPH:
        sizes.append(max_tokens)
    return sizes


def default_decode_sizes(max_num_seqs: int) -> list[int]:
    largest = min(max_num_seqs, MAX_DEFAULT_DECODE_BUCKET)
    sizes = [n for n in (1, 2, 4, 8) if n <= largest]
    sizes += list(range(16, min(largest, DENSE_DECODE_LIMIT) + 1, 16))
    sizes += list(range(DENSE_DECODE_LIMIT + 64, min(largest, MEDIUM_DECODE_LIMIT) + 1, 64))
    sizes += list(range(MEDIUM_DECODE_LIMIT + 128, largest + 1, 128))
    if largest not in sizes:
        sizes.append(largest)
    return sorted(set(sizes))


def default_token_sizes(max_num_batched_tokens: int) -> list[int]:
    sizes = []
    n = SMALLEST_TOKEN_BUCKET
    while n < max_num_batched_tokens:
        sizes.append(n)
        n *= 2
    sizes.append(max_num_batched_tokens)
    return sizes


@dataclass(frozen=True)
class BucketPlan:
    """The decode and token buckets of one engine configuration, smallest first."""

    decode: tuple[Bucket, ...]
    tokens: tuple[Bucket, ...]
    max_num_seqs: int
    max_num_batched_tokens: int

    def buckets(self) -> list[Bucket]:
        return list(self.decode) + list(self.tokens)

    def __len__(self) -> int:
        return len(self.decode) + len(self.tokens)

    def bucket_for(self, num_tokens: int, num_seqs: int) -> Bucket:
        """The smallest bucket a step of `num_tokens` tokens from `num_seqs` sequences fits in.

        A pure-decode step goes to a decode bucket when one fits, since those pad the least;
        anything else (or a decode batch larger than every decode bucket) to a token bucket.
        """
        if num_tokens < 1 or num_seqs < 1 or num_seqs > num_tokens:
            raise ValueError(f"a step has {num_tokens} tokens from {num_seqs} sequences: not a valid step")
        if num_tokens == num_seqs:
            for b in self.decode:
                if b.fits(num_tokens, num_seqs):
                    return b
        for b in self.tokens:
            if b.fits(num_tokens, num_seqs):
                return b
        raise BucketPlanError(
            f"no bucket holds a step of {num_tokens} tokens from {num_seqs} sequences; the largest token "
            f"bucket is {self.tokens[-1].name if self.tokens else 'none'} (max_num_batched_tokens="
            f"{self.max_num_batched_tokens}, max_num_seqs={self.max_num_seqs})"
        )

    def describe(self) -> str:
        """One line per bucket: name and static shapes (what `kiln compile --dry-run` prints)."""
        lines = [f"bucket plan: {len(self.decode)} decode + {len(self.tokens)} token buckets "
                 f"(max_num_seqs={self.max_num_seqs}, max_num_batched_tokens={self.max_num_batched_tokens})"]
        for b in self.buckets():
            lines.append(f"  {b.name:<14} tokens={b.num_tokens:<6} seqs={b.num_seqs:<5} sampled rows={b.num_samples}")
        return "\n".join(lines)


def _check_sizes(what: str, sizes: Iterable[int]) -> list[int]:
    out = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise BucketPlanError(f"{what} bucket sizes must be positive integers; got {s!r}")
        out.append(s)
    if not out:
        raise BucketPlanError(f"{what} buckets: give at least one size")
    return sorted(set(out))


def make_bucket_plan(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    decode_sizes: Iterable[int] | None = None,
    token_sizes: Iterable[int] | None = None,
) -> BucketPlan:
    """The plan for an engine's limits; explicit sizes replace the defaults of their kind.

    Token buckets must reach `max_num_batched_tokens` (the scheduler may fill a step that
    far) and no bucket may exceed the limits, or it could never be used.
    """
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise BucketPlanError("max_num_seqs and max_num_batched_tokens must be >= 1")
    decode = (_check_sizes("decode", decode_sizes) if decode_sizes is not None
              else default_decode_sizes(min(max_num_seqs, max_num_batched_tokens)))
    tokens = _check_sizes("token", token_sizes) if token_sizes is not None else default_token_sizes(max_num_batched_tokens)
    too_many = [n for n in decode if n > max_num_seqs or n > max_num_batched_tokens]
    if too_many:
        raise BucketPlanError(
            f"decode buckets {too_many} exceed max_num_seqs={max_num_seqs} (or max_num_batched_tokens="
            f"{max_num_batched_tokens}); drop them or raise the limit"
        )
    if max(tokens) < max_num_batched_tokens:
        raise BucketPlanError(
            f"the largest token bucket ({max(tokens)}) is below max_num_batched_tokens={max_num_batched_tokens}: "
            f"a full step would have no bucket; add a token bucket of {max_num_batched_tokens} or lower "
            "max_num_batched_tokens"
        )
    if max(tokens) > max_num_batched_tokens:
        raise BucketPlanError(
            f"token buckets {[t for t in tokens if t > max_num_batched_tokens]} exceed max_num_batched_tokens="
            f"{max_num_batched_tokens}; the scheduler never fills them"
        )
    return BucketPlan(
        decode=tuple(decode_bucket(n) for n in decode),
        tokens=tuple(token_bucket(n, max_num_seqs, holds_any_step=n == max_num_batched_tokens) for n in tokens),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )


def parse_bucket_spec(items: Iterable[str]) -> tuple[list[int] | None, list[int] | None]:
    """`["decode:1,2,4", "tokens:64,128"]` -> ([1, 2, 4], [64, 128]); a kind not named is None (default)."""
    decode: list[int] | None = None
    tokens: list[int] | None = None
    for item in items:
        kind, sep, values = item.partition(":")
        kind = kind.strip().lower()
        if not sep or kind not in (DECODE, TOKENS):
            raise BucketPlanError(f"--buckets {item!r}: expected 'decode:N,N,...' or 'tokens:N,N,...'")
        try:
            sizes = [int(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise BucketPlanError(f"--buckets {item!r}: sizes must be integers separated by commas") from None
        sizes = _check_sizes(kind, sizes)
        if kind == DECODE:
            decode = sorted(set((decode or []) + sizes))
        else:
            tokens = sorted(set((tokens or []) + sizes))
    return decode, tokens
