"""Model sources: HF directories (one or many shards), GGUF, dummy; clear errors for bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import tiny_config

from kiln.compiler.capture import UnsupportedArchitectureError, capture
from kiln.compiler.model_source import (ALLOW_TORCHVISION_ENV, ModelSourceError, default_model_path, resolve_model,
                                       text_only_transformers)
from kiln.runtime import LLM, SamplingParams

BENCH_CONFIG = Path(__file__).resolve().parents[1] / "bench" / "llama3_8b.json"


def test_missing_path_is_named(tmp_path) -> None:
    with pytest.raises(ModelSourceError, match="does not exist: .*nowhere"):
        resolve_model(tmp_path / "nowhere")


def test_directory_without_config(tmp_path) -> None:
    with pytest.raises(ModelSourceError, match="has no config.json"):
        resolve_model(tmp_path)


def test_config_missing_field_is_named(tmp_path) -> None:
    cfg = tiny_config("llama").to_dict()
    del cfg["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSourceError, match="config.json lacks required field.*num_attention_heads"):
        resolve_model(tmp_path)


def test_unknown_architecture_in_config(tmp_path) -> None:
    cfg = tiny_config("llama").to_dict() | {"model_type": "not-a-model"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSourceError, match="unknown architecture model_type='not-a-model'") as e:
        resolve_model(tmp_path)
    # Not transformers' list of every model type it knows (12,000 characters): Kiln's own.
    assert len(str(e.value)) < 400 and "llama" in str(e.value), str(e.value)[:500]


def test_unsupported_architecture_fails_at_capture_naming_the_construct() -> None:
    from transformers import RwkvConfig

    with pytest.raises(UnsupportedArchitectureError, match=r"state-space / recurrent layer \(parameter .*time_decay\)"):
        capture(RwkvConfig(num_hidden_layers=1, hidden_size=32, vocab_size=64, attention_hidden_size=32,
                           intermediate_size=64))


def test_a_fused_tensor_transformers_splits_is_read_as_its_parts() -> None:
    """Sarvam's checkpoints keep q, k and v as one `query_key_value`, which transformers splits
    as it loads: each projection's alias names its run of rows (found by reverting
    transformers' own conversion), never the whole fused tensor. (Its parity, and Lara's fused
    `in_proj`, in tests/test_parity.py.)"""
    captured = capture(tiny_config("sarvam_moe"))
    fused = "model.layers.0.attention.query_key_value.weight"
    runs = {part: captured.param_aliases[f"model.layers.0.self_attn.{part}_proj.weight"][-1] for part in "qkv"}
    # 4 query heads and 2 KV heads of 16: q rows 0-64, k 64-96, v 96-128.
    assert runs == {"q": f"{fused}#0:0:64", "k": f"{fused}#0:64:96", "v": f"{fused}#0:96:128"}


def test_sharded_checkpoint_and_missing_tensor(tiny_model_dir, tmp_path) -> None:
    src, _ = tiny_model_dir("llama")
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    shutil.copy(src / "config.json", tmp_path / "config.json")
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    prompt = [4, 8, 15, 16, 23, 42]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    sharded = LLM(str(tmp_path), progress=False).generate([prompt], params)[0].outputs[0].token_ids
    whole = LLM(str(src), progress=False).generate([prompt], params)[0].outputs[0].token_ids
    assert sharded == whole

    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    save_file({n: tensors[n] for n in names[half:-1]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    with pytest.raises(ModelSourceError, match=f"tensor '{names[-1]}' is in none of the weight shards"):
        LLM(str(tmp_path), progress=False)


def test_dummy_weights_are_deterministic(tiny_model_dir) -> None:
    src, _ = tiny_model_dir("qwen3")
    a = resolve_model(src, load_format="dummy")
    names = {"model.layers.0.self_attn.q_proj.weight": ["model.layers.0.self_attn.q_proj.weight"],
             "model.layers.0.input_layernorm.weight": ["model.layers.0.input_layernorm.weight"]}
    w1 = a.load_weights(names, torch.float32, "cpu")
    w2 = resolve_model(src / "config.json", load_format="dummy").load_weights(names, torch.float32, "cpu")
    for n in names:
        torch.testing.assert_close(w1[n], w2[n], rtol=0, atol=0)
    assert w1["model.layers.0.input_layernorm.weight"].eq(1).all()
    assert 0.01 < w1["model.layers.0.self_attn.q_proj.weight"].std() < 0.03


def test_bare_config_needs_dummy(tiny_model_dir) -> None:
    src, _ = tiny_model_dir("qwen3")
    with pytest.raises(ModelSourceError, match="bare config"):
        resolve_model(src / "config.json")


def test_default_model_is_the_smollm2_gguf() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    source = resolve_model(None)
    assert source.kind == "gguf" and source.config.model_type == "llama"
    assert source.config.num_hidden_layers == 30


def test_corrupt_gguf_is_named(tmp_path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelSourceError, match="cannot read GGUF file .*broken.gguf"):
        resolve_model(bad)


def test_text_only_transformers_hides_torchvision_and_restores_it(tmp_path, monkeypatch) -> None:
    # A stand-in torchvision on the path: importable outside the context, absent inside it.
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text("IMPORTED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    monkeypatch.delenv(ALLOW_TORCHVISION_ENV, raising=False)
    with text_only_transformers():
        assert importlib.util.find_spec("torchvision") is None
        with pytest.raises(ImportError):
            import torchvision  # noqa: F401
    assert "torchvision" not in sys.modules
    assert importlib.util.find_spec("torchvision") is not None
    # Already imported by the host program, or allowed by the environment: left alone.
    import torchvision  # noqa: F401

    with text_only_transformers():
        assert sys.modules["torchvision"].IMPORTED
    monkeypatch.delitem(sys.modules, "torchvision")
    monkeypatch.setenv(ALLOW_TORCHVISION_ENV, "1")
    with text_only_transformers():
        assert importlib.util.find_spec("torchvision") is not None


def test_config_resolution_does_not_import_torchvision_or_dynamo(tmp_path) -> None:
    # In a fresh process, with a torchvision on the path that records being imported.
    (tmp_path / "torchvision").mkdir()
    marker = tmp_path / "imported"
    (tmp_path / "torchvision" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    code = ("import sys; from kiln.compiler.model_source import resolve_model; "
            f"resolve_model({str(BENCH_CONFIG)!r}, 'dummy'); print('torch._dynamo' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env.pop(ALLOW_TORCHVISION_ENV, None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"
    assert not marker.exists()
