"""Issue 21, for kernel authors: the test helper gives the graph a pass really receives, the
pipeline says what each pass did (and why an enabled one matched nothing), a broken plugin
says why, `kiln cache info` names the passes, and token-id prompts work on the CLI."""

from __future__ import annotations

import json
import logging
from importlib.metadata import EntryPoint, entry_points

import pytest
import torch
import torch.nn.functional as F
from tiny_models import COMMON, tiny_config

from kiln.compiler.capture import capture
from kiln.compiler.pass_testing import capture_through, graph_for_pass, run_graph, single_sequence_batch
from kiln.passes import PassContext, PassManager
from kiln.passes.base import KilnPass
from kiln.passes.fuse_common import CudaByDefault
from kiln.passes.pattern import Pattern, PatternPass
from kiln.runtime.cli import main

LAYERS = COMMON["num_hidden_layers"]


class Probe(KilnPass):
    """Records the graph it receives."""

    name = "probe"
    phase = "fusion"

    def __init__(self) -> None:
        self.seen: str | None = None

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, int]:
        self.seen = gm.code
        return {}


def silu_times_up(gate, up):
    return F.silu(gate) * up


class PluginSiluMul(PatternPass):
    """What a plugin author writes when the built-in fuse_silu_mul already exists."""

    name = "plugin_silu_mul"
    phase = "fusion"
    patterns = (Pattern("plugin_silu_mul", silu_times_up, silu_times_up, (torch.randn(1, 4, 32), torch.randn(1, 4, 32))),)


def default_pipeline(on_cpu: bool, extra: list, disable: list[str] | None = None) -> PassManager:
    pm = PassManager.default(disable=disable)
    for p in pm.passes:
        if isinstance(p, CudaByDefault):
            p.on_cpu = on_cpu
    return PassManager(list(pm.passes) + extra)


def test_graph_for_pass_is_exactly_what_the_pipeline_hands_the_pass() -> None:
    """With the CUDA pipeline's fusions (the CPU policy is covered by the example plugin's test)."""
    config = tiny_config("llama")
    cpu_fusions = True
    probe = Probe()
    default_pipeline(cpu_fusions, [probe]).run(capture(config).graph_module, PassContext(config=config))
    helper = graph_for_pass(config, Probe(), cpu_fusions=cpu_fusions)
    assert helper.graph_module.code == probe.seen
    # Every built-in up to the end of the fusion phase, in the manager's order.
    assert helper.pipeline == [p.name for p in PassManager.default().passes if p.phase != "logits"]
    # shard_tensor_parallel is in every pipeline; at tp=1 it changes nothing (and recurrent_state
    # nothing on a model without gated DeltaNet layers).
    assert helper.pipeline[:6] == ["normalize", "shard_tensor_parallel", "paged_kv", "recurrent_state", "merge_qkv",
                                   "merge_gate_up"]
    assert ("silu_and_mul" in probe.seen) is cpu_fusions  # the device policy of the built-ins is the engine's
    # A built-in by name: the passes before it, and not the pass itself.
    assert graph_for_pass(config, "merge_gate_up").pipeline == ["normalize", "shard_tensor_parallel", "paged_kv",
                                                                "recurrent_state", "merge_qkv"]


def test_run_graph_merges_real_weights_as_the_loader_does(tiny_model_dir) -> None:
    """After merge_qkv / merge_gate_up, run_graph on the HF model's own weights gives HF's logits."""
    _, hf = tiny_model_dir("llama")
    graph = graph_for_pass(hf.config, "prune_logits")  # every fusion-phase pass ran
    assert any("qkv_proj" in t.output for t in graph.context.weight_transforms)
    weights = dict(hf.state_dict())
    out = run_graph(graph, num_tokens=8, weights=weights)
    ids = single_sequence_batch(8, graph.block_size, hf.config.vocab_size)["input_ids"]
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    torch.testing.assert_close(out.reshape(want.shape), want, atol=1e-4, rtol=1e-4)
    assert set(weights) == set(hf.state_dict())  # the caller's dict is not consumed
    # The failure: the merged graph on random weights (KeyError on qkv_proj before).
    merged = capture_through(hf.config, "fusion", inclusive=True)
    assert torch.isfinite(run_graph(merged)).all()


def test_pass_stats_are_logged_and_a_consumed_pattern_is_named(caplog) -> None:
    config = tiny_config("llama")
    with caplog.at_level(logging.INFO, logger="kiln.passes"):
        report = default_pipeline(True, [PluginSiluMul()]).run(capture(config).graph_module, PassContext(config=config))
    messages = [r.getMessage() for r in caplog.records if r.name == "kiln.passes"]
    assert f"pass merge_qkv (fusion phase): qkv_proj_merged={LAYERS}, inputs_added={LAYERS}" in messages
    assert f"pass plugin_silu_mul (fusion phase): plugin_silu_mul=0" in messages
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert ("pass 'plugin_silu_mul' matched nothing: its pattern 'plugin_silu_mul' needs aten.silu.default, "
            f"which the graph had until pass 'fuse_silu_mul' ({LAYERS} -> 0) rewrote it away") in warnings[0]
    assert "--disable-pass fuse_silu_mul" in warnings[0]
    record = {r.name: r for r in report.records}["plugin_silu_mul"]
    assert record.notes == warnings

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kiln.passes"):
        report = default_pipeline(True, [PluginSiluMul()], disable=["fuse_silu_mul"]).run(
            capture(config).graph_module, PassContext(config=config))
    assert {r.name: r for r in report.records}["plugin_silu_mul"].stats == {"plugin_silu_mul": LAYERS}
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_verbose_shows_pass_stats_and_quiet_hides_them() -> None:
    from kiln.runtime.cli.common import setup_logging

    logger = logging.getLogger("kiln.passes")
    saved = logger.level
    try:
        setup_logging(False)
        assert not logger.isEnabledFor(logging.INFO) and logger.isEnabledFor(logging.WARNING)
        setup_logging(True)
        assert logger.isEnabledFor(logging.INFO)
    finally:
        logger.setLevel(saved)


@pytest.fixture
def broken_plugin(monkeypatch):
    """An installed plugin whose module does not import."""
    from kiln.passes import registry
    from kiln.runtime.cli import passes as cli_passes

    broken = EntryPoint(name="broken_fusion", value="kiln_h21_no_such_module:Pass", group="kiln.passes")

    def with_broken(group: str | None = None):
        return [*entry_points(group=group), broken] if group == "kiln.passes" else entry_points(group=group)

    monkeypatch.setattr(registry, "entry_points", with_broken)
    monkeypatch.setattr(cli_passes, "entry_points", with_broken)
    monkeypatch.setattr(registry, "_LOADED", {})
    return broken


def test_a_broken_plugin_says_why_once(capsys, caplog, broken_plugin) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.passes"):
        assert main(["passes", "list"]) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if "broken_fusion" in line)
        assert "ERROR: ModuleNotFoundError: No module named 'kiln_h21_no_such_module'" in row
        assert main(["passes", "list", "--json"]) == 0
        listed = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
        assert listed["broken_fusion"]["error"].startswith("ModuleNotFoundError")

        assert main(["passes", "list", "--enable-pass", "broken_fusion"]) == 2
        err = capsys.readouterr().err
        assert "--enable-pass 'broken_fusion': the plugin providing it failed to load: ModuleNotFoundError" in err
        assert "no such pass" not in err
    logged = [r for r in caplog.records if "broken_fusion" in r.getMessage()]
    assert len(logged) == 1  # once per process, not once per lookup
    assert main(["passes", "list", "--enable-pass", "no_such_pass_at_all"]) == 2
    assert "no such pass" in capsys.readouterr().err


def test_cache_info_names_the_passes(capsys, tiny_model_dir, tmp_path) -> None:
    from kiln.cache.store import ArtifactStore

    model = str(tiny_model_dir("llama")[0])
    cache = str(tmp_path / "cache")
    assert main(["compile", model, "--compile", "graph", "--cache-dir", cache, "--device", "cpu",
                 "--max-num-seqs", "1", "--max-num-batched-tokens", "16"]) == 0
    capsys.readouterr()
    with ArtifactStore(cache) as store:
        manifests = {m.kind: m for m in store.manifests()}
    assert main(["cache", "info", manifests["graph"].key, "--cache-dir", cache]) == 0
    passes = {p["name"]: p for p in json.loads(capsys.readouterr().out)["passes"]}
    assert passes["merge_qkv"]["stats"] == {"qkv_proj_merged": LAYERS, "inputs_added": LAYERS}
    assert passes["merge_qkv"]["phase"] == "fusion" and len(passes["merge_qkv"]["uuid"]) == 16
    other = next(m for kind, m in manifests.items() if kind != "graph")
    assert main(["cache", "info", other.key, "--cache-dir", cache]) == 0
    names = [p["name"] for p in json.loads(capsys.readouterr().out)["passes"]]
    assert "merge_qkv" in names and "paged_kv" in names


def test_generate_takes_token_id_prompts(capsys, tiny_model_dir) -> None:
    """A save_pretrained directory has no tokenizer: token-id prompts in, token ids out."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    model = str(tiny_model_dir("llama")[0])
    base = ["generate", "--model", model, "--device", "cpu", "--max-tokens", "5", "--ignore-eos", "--num-kv-blocks", "16"]
    assert main([*base, "--prompt-token-ids", "1,5,9", "--prompt-token-ids", "7, 7"]) == 0
    out = capsys.readouterr().out
    llm = LLM(model, device="cpu", num_kv_blocks=16, progress=False)
    want = [o.outputs[0].token_ids for o in llm.generate([[1, 5, 9], [7, 7]],
                                                        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))]
    assert out == (f"--- [1/2] [1, 5, 9]\n[1, 5, 9] -> {' '.join(map(str, want[0]))}\n"
                   f"--- [2/2] [7, 7]\n[7, 7] -> {' '.join(map(str, want[1]))}\n")
    assert main([*base, "some text"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--prompt-token-ids", "1,x"])
    assert "not a comma-separated list of token ids" in capsys.readouterr().err
    assert main([*base]) == 2
    assert "--prompt-token-ids" in capsys.readouterr().err


def test_a_warm_start_logs_the_cached_pass_stats(tmp_path, caplog) -> None:
    """No pass runs on a warm start; -v still says what they did, from the cached graph spec."""
    from kiln.compiler.startup import CompileOptions, prepare_for_engine

    config = tiny_config("llama")
    options = CompileOptions(mode="graph", cache_dir=str(tmp_path), max_num_seqs=1, max_num_batched_tokens=16,
                             progress=False)
    with caplog.at_level(logging.INFO, logger="kiln.passes"):
        cold = prepare_for_engine(options, config, torch.float32, torch.device("cpu"))
    assert cold.report.captured
    assert f"pass merge_qkv (fusion phase): qkv_proj_merged={LAYERS}, inputs_added={LAYERS}" in caplog.messages
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kiln.passes"):
        warm = prepare_for_engine(options, config, torch.float32, torch.device("cpu"))
    assert not warm.report.captured
    assert (f"pass merge_qkv (fusion phase, from the cache): qkv_proj_merged={LAYERS}, inputs_added={LAYERS}"
            in caplog.messages)


def test_passes_show_prints_the_consumed_pattern_note(capsys, monkeypatch, tiny_model_dir) -> None:
    from kiln.passes import registry

    monkeypatch.setattr(registry, "plugin_pass_factories", lambda: {"plugin_silu_mul": PluginSiluMul})
    monkeypatch.setenv("KILN_CPU_FUSIONS", "1")
    model = str(tiny_model_dir("llama")[0])
    argv = ["passes", "show", model, "--phase", "fusion", "--no-code", "--enable-pass", "plugin_silu_mul"]
    assert main([*argv, "--json"]) == 0
    notes = {p["name"]: p["notes"] for p in json.loads(capsys.readouterr().out)["passes"]}
    assert notes["fuse_silu_mul"] == [] and "'fuse_silu_mul' (2 -> 0)" in notes["plugin_silu_mul"][0]
    assert main(argv) == 0
    assert "note: pass 'plugin_silu_mul' matched nothing" in capsys.readouterr().out
