"""Kiln's artifact cache (keys, the diskcache-backed store, manifests)."""
