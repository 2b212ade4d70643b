"""`kiln passes list` and `kiln passes show`, run through the real `kiln` entry point."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.passes import PassManager
from kiln.runtime.cli import main


def run_kiln(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return str(tiny_model_dir("llama")[0])


def test_list_shows_every_builtin_with_its_uuid(capsys) -> None:
    code, out, _ = run_kiln(capsys, "passes", "list", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    default = PassManager.default().uuids()
    for name, uuid in default.items():
        assert rows[name]["enabled"] is True and rows[name]["uuid"] == uuid
    assert [r["phase"] for r in json.loads(out)] == sorted((r["phase"] for r in json.loads(out)),
                                                           key=["normalize", "attention", "fusion", "logits", "?"].index)
    code, out, _ = run_kiln(capsys, "passes", "list")
    assert code == 0
    header, *lines = out.splitlines()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert header.split() == ["phase", "name", "uuid", "enabled", "runs", "on", device, "source"]
    assert any(line.split()[:2] == ["attention", "paged_kv"] and "yes" in line.split() for line in lines)
    # The CUDA-only fusions say so on a CPU machine (enabled, but skipped there).
    rope = next(line for line in lines if line.split()[1:2] == ["fuse_rope"])
    assert ("no: CUDA only" in rope) == (device == "cpu"), rope


def test_list_follows_enable_and_disable(capsys) -> None:
    code, out, _ = run_kiln(capsys, "passes", "list", "--json", "--disable-pass", "prune_logits")
    assert code == 0 and {r["name"]: r["enabled"] for r in json.loads(out)}["prune_logits"] is False
    code, _, err = run_kiln(capsys, "passes", "list", "--enable-pass", "no_such_pass")
    assert code == 2 and "'no_such_pass'" in err and "known:" in err
    code, _, err = run_kiln(capsys, "passes", "list", "--disable-pass", "paged_kv")
    assert code == 2 and "paged_kv pass cannot be disabled" in err


def test_show_phases(capsys, llama_dir) -> None:
    code, out, _ = run_kiln(capsys, "passes", "show", llama_dir, "--phase", "captured", "--json", "--no-code")
    captured = json.loads(out)
    assert code == 0 and captured["passes"] == [] and captured["op_counts"]["aten._assert_tensor_metadata.default"] > 0

    code, out, _ = run_kiln(capsys, "passes", "show", llama_dir, "--phase", "normalize", "--json")
    normalized = json.loads(out)
    assert [p["name"] for p in normalized["passes"]] == ["normalize", "shard_tensor_parallel"]  # a no-op at tp=1
    assert "aten._assert_tensor_metadata.default" not in normalized["op_counts"]
    assert normalized["passes"][0]["stats"]["asserts_removed"] == captured["op_counts"]["aten._assert_tensor_metadata.default"]
    assert "def forward" in normalized["code"] and "kiln.attention.default" in normalized["code"]
    assert normalized["architecture"] == "llama" and normalized["num_layers"] == 2

    code, out, _ = run_kiln(capsys, "passes", "show", llama_dir, "--json", "--no-code")  # default: the final graph
    final = json.loads(out)
    assert [p["name"] for p in final["passes"]] == list(PassManager.default().uuids())
    assert final["op_counts"]["kiln.paged_attention.default"] == 2 and final["op_counts"]["aten.index_select.default"] == 1
    assert "code" not in final


def test_show_text_has_graph_counts_and_stats(capsys, llama_dir, tmp_path) -> None:
    code, out, _ = run_kiln(capsys, "passes", "show", llama_dir, "--phase", "attention", "--dump-graphs", str(tmp_path))
    assert code == 0
    assert "# graph after phase 'attention'" in out
    assert "torch.ops.kiln.paged_attention.default(" in out
    counts = out.split("op counts:\n", 1)[1].split("\n\n", 1)[0]
    assert any(line.split() == ["2", "kiln.paged_attention.default"] for line in counts.splitlines())
    stats = out.split("passes run", 1)[1]
    assert "paged_kv" in stats and "attention_replaced=2" in stats
    assert (tmp_path / "02-attention.py").read_text().strip() in out


def test_show_explain_needs_a_pattern_pass(capsys, llama_dir) -> None:
    code, _, err = run_kiln(capsys, "passes", "show", llama_dir, "--explain", "prune_logits", "--no-code")
    assert code == 2 and "not a pattern pass" in err


def test_show_bad_model_is_a_clear_error(capsys, tmp_path) -> None:
    code, _, err = run_kiln(capsys, "passes", "show", str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err
