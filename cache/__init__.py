"""Kiln's compile cache: keys (kiln.cache.keys), the diskcache-backed store with checksums,
locking, LRU eviction, export and import (kiln.cache.store), manifests, miss explanations
(kiln.cache.explain), and the `kiln compile` / `kiln cache` commands (kiln.runtime.cli.cache)."""

from kiln.cache.explain import Explanation, explain_miss, explain_setup
from kiln.cache.keys import architecture_fields, bucket_factors, factor_differences, key_for, model_factors
from kiln.cache.manifest import Manifest, checksum
from kiln.cache.store import ArtifactStore, CacheStoreError, default_cache_dir

__all__ = [
    "Explanation", "explain_miss", "explain_setup",
    "architecture_fields", "bucket_factors", "factor_differences", "key_for", "model_factors",
    "Manifest", "checksum", "ArtifactStore", "CacheStoreError", "default_cache_dir",
]
