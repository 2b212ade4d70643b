"""Models by Hugging Face hub id (`org/name`): resolved through huggingface_hub's own code
from a hub cache laid out by hand (tests/hub_cache.py), with HF_HUB_OFFLINE=1: no network."""

from __future__ import annotations

import json
import shutil

import pytest

from kiln.compiler.model_source import ModelSourceError, is_hub_id, resolve_model
from kiln.runtime import LLM, SamplingParams

from hub_cache import add_to_hub_cache
from runtime_text_model import text_model_dir
from tiny_models import tiny_config

REPO = "kiln-test/tiny-chat"
COMMIT, OTHER_COMMIT = "a" * 40, "b" * 40


@pytest.fixture(autouse=True)
def offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(cache dir, the local model dir it was made from)."""
    local = text_model_dir(tmp_path_factory)
    cache = tmp_path_factory.mktemp("hf-hub")
    add_to_hub_cache(cache, REPO, local, COMMIT, refs=("main",))
    add_to_hub_cache(cache, REPO, local, OTHER_COMMIT, refs=("v2",))
    return cache, local


def test_hub_id_generates_like_the_local_directory(hub) -> None:
    cache, local = hub
    params = SamplingParams(temperature=0, max_tokens=6)
    from_hub = LLM(REPO, download_dir=str(cache), progress=False, max_model_len=128, num_kv_blocks=16)
    assert from_hub.engine.source.name == REPO
    assert str(from_hub.engine.source.path).endswith(f"snapshots/{COMMIT}")
    from_dir = LLM(str(local), progress=False, max_model_len=128, num_kv_blocks=16)
    a = from_hub.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    b = from_dir.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 6


def test_revision_picks_the_snapshot(hub) -> None:
    cache, _ = hub
    assert resolve_model(REPO, revision="v2", download_dir=cache).path.name == OTHER_COMMIT
    assert resolve_model(REPO, revision=OTHER_COMMIT, download_dir=cache).path.name == OTHER_COMMIT
    with pytest.raises(ModelSourceError, match=r"kiln-test/tiny-chat@nope is not in the Hugging Face cache.*"
                                               r"HF_HUB_OFFLINE"):
        resolve_model(REPO, revision="nope", download_dir=cache)


def test_uncached_model_offline_says_what_to_do(tmp_path) -> None:
    with pytest.raises(ModelSourceError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE is set.*hf download"):
        resolve_model("someone/not-cached", download_dir=tmp_path)


def test_bin_only_repo_is_refused_clearly(tmp_path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "config.json").write_text(json.dumps(tiny_config("llama").to_dict()))
    (files / "pytorch_model.bin").write_bytes(b"not really a pickle")
    add_to_hub_cache(tmp_path / "cache", "old/bin-only", files)
    with pytest.raises(ModelSourceError, match=r"only PyTorch \.bin weights \(pytorch_model\.bin\).*safetensors"):
        resolve_model("old/bin-only", download_dir=tmp_path / "cache")
    # Dummy weights need only the config: the same repo resolves.
    assert resolve_model("old/bin-only", "dummy", download_dir=tmp_path / "cache").config.model_type == "llama"


def test_remote_code_model_is_refused_clearly(tmp_path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    raw = tiny_config("llama").to_dict() | {"model_type": "my-own-arch",
                                             "auto_map": {"AutoConfig": "configuration_mine.MyConfig"}}
    (files / "config.json").write_text(json.dumps(raw))
    add_to_hub_cache(tmp_path / "cache", "lab/custom", files)
    with pytest.raises(ModelSourceError, match="my-own-arch.*defined by code shipped in the model repo.*"
                                               "trust_remote_code"):
        resolve_model("lab/custom", "dummy", download_dir=tmp_path / "cache")


def test_a_repo_with_auto_map_but_a_known_architecture_loads(tmp_path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    raw = tiny_config("llama").to_dict() | {"auto_map": {"AutoConfig": "configuration_llama.LlamaConfig"}}
    (files / "config.json").write_text(json.dumps(raw))
    add_to_hub_cache(tmp_path / "cache", "lab/llama-with-code", files)
    assert resolve_model("lab/llama-with-code", "dummy", download_dir=tmp_path / "cache").config.model_type == "llama"


def test_separate_tokenizer_by_hub_id(hub, tmp_path) -> None:
    """tokenizer= takes a hub id: a model directory without tokenizer files gets one."""
    cache, local = hub
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(local / f, bare / f)
    llm = LLM(str(bare), tokenizer=REPO, download_dir=str(cache), progress=False, max_model_len=64, num_kv_blocks=8)
    assert llm.get_tokenizer() is not None
    assert llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("name,hub", [("org/name", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
                                      ("./org/name", False), ("/abs/path", False), ("org/model.gguf", False),
                                      ("name-only", False), ("a/b/c", False), ("org/../x", False)])
def test_what_counts_as_a_hub_id(name, hub) -> None:
    assert is_hub_id(name) is hub
