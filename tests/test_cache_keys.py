"""Cache keys: what makes two setups share artifacts, what does not, and `explain` naming why."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch

from kiln.cache.explain import explain_setup
from kiln.cache.keys import BUCKET_KIND, MODEL_KIND, architecture_fields, bucket_factors, factor_differences
from kiln.cache.manifest import Manifest
from kiln.cache.store import ArtifactStore
from kiln.compiler.startup import ModelSetup
from kiln.compiler.buckets import make_bucket_plan
from kiln.passes.manager import PassManager


def _setup(config, dtype=torch.float32, pm=None, block_size=16, max_num_seqs=2) -> ModelSetup:
    return ModelSetup(config=config, dtype=dtype, device=torch.device("cpu"), pass_manager=pm or PassManager.default(),
                      block_size=block_size, plan=make_bucket_plan(max_num_seqs, 32))


def _config(path):
    from kiln.compiler.model_source import resolve_model

    return resolve_model(str(path)).config


def _fill(store: ArtifactStore, setup: ModelSetup) -> None:
    """Store an entry (placeholder bytes: explain and lookups read only keys and manifests)
    under every key of `setup`, with its real factors."""
    base = setup.model_factors()
    store.put(Manifest(key=setup.model_key(), kind=MODEL_KIND, label="graph", model=setup.model_type, factors=base,
                       checksum="", size=0, created=time.time()), b"spec")
    for bucket, key in setup.bucket_keys().items():
        store.put(Manifest(key=key, kind=BUCKET_KIND, label=bucket.name, model=setup.model_type,
                           factors=bucket_factors(base, bucket), checksum="", size=0, created=time.time()), b"art")


@pytest.fixture(scope="module")
def llama_config(tiny_model_dir):
    return _config(tiny_model_dir("llama")[0])


def test_same_architecture_elsewhere_or_with_other_weights_hits(tmp_path, llama_config):
    """Another directory, other random weights: same keys (weights and paths never enter)."""
    from tiny_models import save_tiny_model

    other = tmp_path / "elsewhere" / "copy-of-llama"
    other.mkdir(parents=True)
    save_tiny_model("llama", other, seed=123)
    a, b = _setup(llama_config), _setup(_config(other))
    assert a.model_key() == b.model_key()
    assert a.bucket_keys() == b.bucket_keys()
    with ArtifactStore(tmp_path / "cache") as store:
        _fill(store, a)
        assert all(row.hit for row in explain_setup(store, b))


def test_key_holds_no_path_or_hostname(tiny_model_dir, llama_config):
    path = str(tiny_model_dir("llama")[0])
    text = json.dumps(_setup(llama_config).model_factors())
    assert path not in text and "/tmp" not in text
    assert socket.gethostname() not in text


def test_capture_does_not_change_the_key(llama_config):
    """Building the HF model sets private state on the config; none of it may enter the key."""
    from kiln.compiler.pipeline import build_model_graph

    before = _setup(llama_config).model_key()
    build_model_graph(llama_config, torch.float32, "cpu")
    assert _setup(llama_config).model_key() == before


def test_architecture_changes_miss(tiny_model_dir, llama_config):
    from tiny_models import tiny_config

    qwen = tiny_config("qwen2")
    assert _setup(qwen).model_key() != _setup(llama_config).model_key()
    deeper = _config(tiny_model_dir("llama")[0])
    deeper.num_hidden_layers = 3
    diffs = factor_differences(_setup(llama_config).model_factors(), _setup(deeper).model_factors())
    assert diffs == [("architecture.num_hidden_layers", 2, 3)]
    assert "name_or_path" not in architecture_fields(llama_config)


def test_dtype_block_size_and_bucket_shape_miss(llama_config):
    base = _setup(llama_config)
    assert _setup(llama_config, dtype=torch.bfloat16).model_key() != base.model_key()
    assert _setup(llama_config, block_size=32).model_key() != base.model_key()
    # tokens-16 holds min(16, max_num_seqs) sequence rows: another max_num_seqs, another shape.
    k2 = {b.name: k for b, k in base.bucket_keys().items()}
    k4 = {b.name: k for b, k in _setup(llama_config, max_num_seqs=4).bucket_keys().items()}
    assert k2["decode-1"] == k4["decode-1"] and k2["decode-2"] == k4["decode-2"]
    assert k2["tokens-16"] != k4["tokens-16"]


def test_pass_option_misses_and_explain_names_it(tmp_path, llama_config):
    """A pass option (here: a fusion pass told to rewrite CPU graphs) changes that pass's uuid,
    so every key misses, and explain names the pass."""
    from kiln.passes.fuse_rmsnorm import FuseRMSNormPass

    default = _setup(llama_config)
    names = [p.name for p in default.pass_manager.passes]
    passes = [FuseRMSNormPass(on_cpu=True) if p.name == "fuse_rmsnorm" else p for p in default.pass_manager.passes]
    assert "fuse_rmsnorm" in names
    changed = _setup(llama_config, pm=PassManager(passes))
    assert changed.model_key() != default.model_key()
    assert not set(changed.bucket_keys().values()) & set(default.bucket_keys().values())
    with ArtifactStore(tmp_path / "cache") as store:
        _fill(store, default)
        rows = explain_setup(store, changed)
        assert not any(r.hit for r in rows)
        for r in rows:
            assert "differs in passes: passes.fuse_rmsnorm" in r.reason, r.reason
            assert "torch" not in r.reason.split(":")[1]


def test_disabled_pass_misses(llama_config):
    assert _setup(llama_config, pm=PassManager.default(disable=["merge_qkv"])).model_key() != \
        _setup(llama_config).model_key()


def test_torch_version_misses_and_explain_names_it(tmp_path, monkeypatch, llama_config):
    """The same setup under another torch version (simulated) misses every entry, and explain
    says torch differs, with both versions."""
    setup = _setup(llama_config)
    with ArtifactStore(tmp_path / "cache") as store:
        _fill(store, setup)
        assert all(r.hit for r in explain_setup(store, setup))
        real = torch.__version__
        monkeypatch.setattr(torch, "__version__", "2.99.0+simulated")
        assert setup.model_key() not in store
        rows = explain_setup(store, setup)
        assert not any(r.hit for r in rows)
        for r in rows:
            assert f"differs in torch: torch ({real} there, 2.99.0+simulated here)" in r.reason, r.reason


def test_explain_on_an_empty_cache(tmp_path, llama_config):
    with ArtifactStore(tmp_path / "empty") as store:
        rows = explain_setup(store, _setup(llama_config))
    assert rows and all(not r.hit and "the cache is empty" in r.reason for r in rows)


def test_explain_bucket_miss_names_the_bucket_factor(tmp_path, llama_config):
    with ArtifactStore(tmp_path / "cache") as store:
        _fill(store, _setup(llama_config, max_num_seqs=2))
        rows = {r.label: r for r in explain_setup(store, _setup(llama_config, max_num_seqs=4))}
    assert rows["graph"].hit and rows["decode-2"].hit
    assert not rows["decode-4"].hit and "differs in bucket" in rows["decode-4"].reason
    assert "bucket.seqs" in rows["tokens-16"].reason
