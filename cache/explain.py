"""Why an entry misses: compare its key factors with the nearest entry the cache holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.cache.keys import (
    BUCKET_KIND, GRAPH_CODE_KIND, MODEL_KIND, TRITON_KERNELS_KIND, bucket_factors, factor_differences,
)
from kiln.cache.manifest import Manifest
from kiln.cache.store import ArtifactStore

MAX_DETAILS = 6


@dataclass
class Explanation:
    label: str  # "graph" or a bucket name
    key: str
    hit: bool
    reason: str  # for a miss: what differs from the nearest entry


def _short(value: Any) -> str:
    text = "absent" if value is None else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def nearest_entry(candidates: list[Manifest], want: dict[str, Any]) -> tuple[Manifest, list[tuple[str, Any, Any]]] | None:
    """The stored manifest whose factors differ from `want` in the fewest places (newest on ties)."""
    best = None
    for m in candidates:
        diffs = factor_differences(m.factors, want)
        rank = (len(diffs), -m.created)
        if best is None or rank < best[0]:
            best = (rank, m, diffs)
    return None if best is None else (best[1], best[2])


def describe_differences(diffs: list[tuple[str, Any, Any]]) -> str:
    """'torch (2.12.0 there, 2.13.0 here); passes.merge_qkv (...)', the top-level factors first."""
    top = sorted({name.split(".")[0] for name, _, _ in diffs})
    details = [f"{name} ({_short(a)} there, {_short(b)} here)" for name, a, b in diffs[:MAX_DETAILS]]
    more = f"; and {len(diffs) - MAX_DETAILS} more" if len(diffs) > MAX_DETAILS else ""
    return f"differs in {', '.join(top)}: " + "; ".join(details) + more


def explain_miss(store: ArtifactStore, kind: str, want: dict[str, Any], manifests: list[Manifest] | None = None) -> str:
    """One sentence: why no entry of `kind` matches the factors `want`."""
    manifests = store.manifests() if manifests is None else manifests
    candidates = [m for m in manifests if m.kind == kind]
    if not candidates:
        what = {MODEL_KIND: "graph spec", GRAPH_CODE_KIND: "graph code",
                TRITON_KERNELS_KIND: "Triton kernels"}.get(kind, "bucket")
        return f"miss: the cache holds no {what} entry at all" if manifests else "miss: the cache is empty"
    found = nearest_entry(candidates, want)
    assert found is not None  # candidates is not empty
    nearest, diffs = found
    if not diffs:
        return f"miss: entry {nearest.key} has identical factors but another key (written by another Kiln version?)"
    return f"miss: nearest entry {nearest.key} ({nearest.model} {nearest.label}) {describe_differences(diffs)}"


def explain_setup(store: ArtifactStore, setup: Any, mode: str = "inductor") -> list[Explanation]:
    """Hit or miss, and why, for the graph spec and every bucket of a `ModelSetup` (mode
    "inductor"), or the graph spec and the graph code (mode "graph"); on CUDA also the
    setup's Triton kernels (kiln.compiler.triton_kernels)."""
    manifests = store.manifests()
    base = setup.model_factors()
    rows = []
    model_key = setup.model_key()
    hit = model_key in store
    rows.append(Explanation("graph", model_key, hit, "hit" if hit else explain_miss(store, MODEL_KIND, base, manifests)))
    if mode == "graph":
        key = setup.graph_code_key()
        hit = key in store
        reason = "hit" if hit else explain_miss(store, GRAPH_CODE_KIND, setup.graph_code_factors(), manifests)
        rows.append(Explanation("graph-code", key, hit, reason))
    else:
        for bucket, key in setup.bucket_keys().items():
            hit = key in store
            reason = "hit" if hit else explain_miss(store, BUCKET_KIND, bucket_factors(base, bucket), manifests)
            rows.append(Explanation(bucket.name, key, hit, reason))
    if setup.device.type == "cuda":
        key = setup.triton_kernels_key()
        hit = key in store
        reason = "hit" if hit else explain_miss(store, TRITON_KERNELS_KIND, setup.triton_kernels_factors(), manifests)
        rows.append(Explanation("triton-kernels", key, hit, reason))
    return rows
