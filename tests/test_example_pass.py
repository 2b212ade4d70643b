"""The out-of-tree example pass (passes/examples/kiln-example-pass), installed as a user would.

CI installs it with the line from passes/README.md (.ci/setup.sh). Installed, it is
listed but off; enabled, it changes the graph, the pass uuids (so the cache key) and not
the greedy tokens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import COMMON

from kiln.passes import PassManager
from kiln.runtime.cli import main

REPO = Path(__file__).resolve().parents[1]
PASS = "fuse_gelu_tanh_and_mul"
FUSED_OP = "kiln_example.gelu_tanh_and_mul.default"
LAYERS = COMMON["num_hidden_layers"]


def run_kiln(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def gelu_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose MLP uses GELU(tanh), with random weights saved as safetensors."""
    path = tmp_path_factory.mktemp("tiny-gelu-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**COMMON, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)  # spread the logits so greedy choices are not near-ties
    model.save_pretrained(path)
    return path


def test_the_readme_install_line_is_what_ci_runs() -> None:
    guide = (REPO / "passes" / "README.md").read_text()
    line = "pip install -e passes/examples/kiln-example-pass"
    assert line in guide
    assert re.search(r"(pip|\$PIP) install .*-e passes/examples/kiln-example-pass", (REPO / ".ci" / "setup.sh").read_text())


def test_installed_through_the_entry_point_and_listed(capsys, monkeypatch) -> None:
    eps = {ep.name: ep for ep in entry_points(group="kiln.passes")}
    assert PASS in eps and eps[PASS].dist.name == "kiln-example-pass"

    code, out, _ = run_kiln(capsys, "passes", "list", "--json")
    row = {r["name"]: r for r in json.loads(out)}[PASS]
    assert code == 0 and row["phase"] == "fusion" and row["enabled"] is False  # plugins are opt-in
    assert row["source"].startswith("plugin kiln-example-pass")

    code, out, _ = run_kiln(capsys, "passes", "list")
    assert any(line.split()[:2] == ["fusion", PASS] and line.split()[3] == "no" for line in out.splitlines())

    code, out, _ = run_kiln(capsys, "passes", "list", "--json", "--enable-pass", PASS)
    assert {r["name"]: r for r in json.loads(out)}[PASS]["enabled"] is True
    monkeypatch.setenv("KILN_ENABLE_PASSES", PASS)
    code, out, _ = run_kiln(capsys, "passes", "list", "--json")
    assert {r["name"]: r for r in json.loads(out)}[PASS]["enabled"] is True


def test_show_op_counts_before_and_after(capsys, gelu_model_dir) -> None:
    base = ("passes", "show", str(gelu_model_dir), "--phase", "fusion", "--json", "--no-code")
    code, out, _ = run_kiln(capsys, *base)
    before = json.loads(out)
    code_after, out, _ = run_kiln(capsys, *base, "--enable-pass", PASS)
    after = json.loads(out)
    assert code == code_after == 0
    assert before["op_counts"]["aten.gelu.default"] == LAYERS and FUSED_OP not in before["op_counts"]
    assert "aten.gelu.default" not in after["op_counts"] and after["op_counts"][FUSED_OP] == LAYERS
    assert after["op_counts"]["aten.mul.Tensor"] == before["op_counts"]["aten.mul.Tensor"] - LAYERS
    stats = {p["name"]: p["stats"] for p in after["passes"]}
    assert stats[PASS] == {"gelu_tanh_and_mul": LAYERS}
    assert PASS not in {p["name"] for p in before["passes"]}


def test_changes_the_pass_uuids_that_key_the_cache() -> None:
    without = PassManager.default().uuids()
    with_pass = PassManager.default(enable=[PASS]).uuids()
    assert PASS not in without and len(with_pass[PASS]) == 16
    assert with_pass != without and {k: v for k, v in with_pass.items() if k != PASS} == without


def test_a_compile_with_it_misses_the_cache_built_without_it(gelu_model_dir, tmp_path) -> None:
    """`kiln compile` without the pass, then `kiln cache explain` with and without it."""
    opts = (str(gelu_model_dir), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu", "--dtype", "float32",
            "--buckets", "decode:1", "tokens:16", "--max-num-batched-tokens", "16", "--max-num-seqs", "1")

    def kiln(*argv: str) -> str:  # the installed CLI, in its own process, as a user runs it
        done = subprocess.run([sys.executable, "-m", "kiln.runtime.cli", *argv], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "KILN_ENABLE_PASSES": ""})
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    kiln("compile", *opts)
    assert "3 of 3 entries would hit" in kiln("cache", "explain", *opts)
    out = kiln("cache", "explain", *opts, "--enable-pass", PASS)
    uuid = PassManager.default(enable=[PASS]).uuids()[PASS]
    assert "0 of 3 entries would hit" in out
    misses = [line for line in out.splitlines() if " miss: " in line]
    assert len(misses) == 3
    assert all(f"passes.{PASS} (absent there, {uuid} here)" in line for line in misses)


def test_explain_on_a_model_without_gelu(capsys, tiny_model_dir) -> None:
    silu_dir = tiny_model_dir("llama")[0]
    code, out, _ = run_kiln(capsys, "passes", "show", str(silu_dir), "--explain", PASS, "--no-code", "--device", "cpu")
    assert code == 0
    assert f"before pass '{PASS}'" in out
    assert "pattern 'gelu_tanh_and_mul' (traced for float32): no match" in out
    assert "pattern ops absent from the graph: aten.gelu.default" in out


def test_greedy_tokens_identical_with_and_without(gelu_model_dir) -> None:
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    prompts = [[1, 5, 9, 33, 2], [7, 7, 100, 3], [64, 12]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for enabled in (False, True):
        llm = LLM(model=str(gelu_model_dir), device="cpu", num_kv_blocks=32, max_num_seqs=4, progress=False,
                  enable_passes=[PASS] if enabled else [])
        ops = {str(n.target) for n in llm.engine.graph.graph_module.graph.nodes}
        assert (FUSED_OP in ops) is enabled and ("aten.gelu.default" in ops) is not enabled
        results[enabled] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert all(len(t) == 12 for t in results[False])
    assert results[True] == results[False]
