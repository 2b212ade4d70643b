"""The CUDA artifact form, `standalone_compile` artifacts (kiln.compiler.inductor_compile), run
on CPU by forcing it (KILN_INDUCTOR_STANDALONE=1): one process compiles two buckets, a fresh
one with an empty Inductor cache and a KV cache of another size loads them, runs no Dynamo,
and generates what the eager graph generates. On CPU a standalone artifact rebuilds its C++
kernels when loaded (why CPU uses AOTInductor packages); on CUDA it carries its Triton
kernels, and tests/test_compile_gpu.py checks that nothing is compiled there."""

from __future__ import annotations

import pytest

from test_warm_start import TINY_PROMPTS, TINY_SETTINGS, run_worker

STANDALONE = {"KILN_INDUCTOR_STANDALONE": "1"}


def test_standalone_artifacts_cold_then_warm_with_another_kv_cache_size(tiny_model_dir, tmp_path):
    from kiln.cache.store import ArtifactStore
    from kiln.compiler.inductor_compile import STANDALONE_FORMAT

    model = str(tiny_model_dir("llama")[0])
    cache = str(tmp_path / "cache")
    common = {"model": model, "cache_dir": cache, "compile": "inductor", **TINY_SETTINGS, "prompts": TINY_PROMPTS,
              "max_tokens": 10}
    cold = run_worker({**common, "check_eager": True}, env=STANDALONE)
    assert cold["mode"] == "inductor" and cold["compiled"] == 2
    assert cold["tokens"] == cold["eager_tokens"]
    with ArtifactStore(cache) as store:
        formats = {m.label: m.factors["format"] for m in store.manifests() if m.kind == "bucket"}
    assert formats == {"decode-1": STANDALONE_FORMAT, "tokens-16": STANDALONE_FORMAT}
    # num_blocks and the block-table width are dynamic in the artifact: another KV cache size
    # (and steps with other widths) run through the same artifacts.
    warm = run_worker({**common, "require_cache": True, "num_kv_blocks": 37}, env={
        **STANDALONE, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "fresh-inductor")})
    assert warm["from_cache"] == 2 and warm["compiled"] == 0 and not warm["captured"]
    assert warm["counters"].get("frames", {}).get("ok", 0) == 0  # no Dynamo
    assert warm["counters"].get("inductor", {}).get("fxgraph_cache_miss", 0) == 0  # no Inductor codegen
    assert warm["tokens"] == cold["tokens"]
    assert set(warm["bucket_counts"]) == {"decode-1", "tokens-16"}


@pytest.mark.parametrize("device, env, want", [("cpu", {}, "aoti-pt2/1"), ("cuda", {}, "inductor-standalone/1"),
                                               ("cpu", STANDALONE, "inductor-standalone/1")])
def test_artifact_form_by_device(device, env, want, monkeypatch):
    import torch

    from kiln.compiler.inductor_compile import STANDALONE_ENV, artifact_format

    monkeypatch.delenv(STANDALONE_ENV, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert artifact_format(torch.device(device)) == want
