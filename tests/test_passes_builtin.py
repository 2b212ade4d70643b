"""Built-in passes as before-graph -> after-graph: op counts, inputs added, same numbers."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import tiny_config

from kiln.compiler.capture import capture, graph_input_roles
from kiln.passes import PassContext, PassManager, op_counts
from kiln.passes.base import KilnPass
from kiln.passes.normalize import NormalizePass
from kiln.passes.paged_kv import PagedKVPass
from kiln.passes.prune_logits import PruneLogitsPass

T = 6


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    return capture(tiny_config("llama"))


def random_weights(cm) -> dict[str, torch.Tensor]:
    from kiln.compiler.capture import parameter_shapes

    shapes = parameter_shapes(cm.config)
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(shapes[n], generator=g) * 0.1 for n in cm.param_aliases}


def run_graph(gm: torch.fx.GraphModule, cm, batch: dict[str, torch.Tensor], kv: list[torch.Tensor] | None = None):
    weights = random_weights(cm)
    args = []
    for role in graph_input_roles(gm):
        kind, _, name = role.partition(":")
        args.append({"param": lambda: weights[name], "constant": lambda: cm.constants[name],
                     "batch": lambda: batch[name], "kv_cache": lambda: kv[int(name)]}[kind]())
    with torch.no_grad():
        return gm(*args)


def single_sequence_batch(t: int, block_size: int = 4) -> dict[str, torch.Tensor]:
    n_blocks = -(-t // block_size)
    return {
        "input_ids": torch.arange(1, t + 1).unsqueeze(0),
        "position_ids": torch.arange(t).unsqueeze(0),
        "slot_mapping": torch.arange(block_size, block_size + t),  # blocks 1.. (0 is the null block)
        "block_tables": torch.arange(1, n_blocks + 1, dtype=torch.int32).unsqueeze(0),
        "seq_lens": torch.tensor([t], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, t], dtype=torch.int32),
        "logits_indices": torch.tensor([t - 1]),
    }


def test_normalize_strips_asserts_and_noop_casts(captured) -> None:
    gm = copy.deepcopy(captured.graph_module)
    before = op_counts(gm)
    assert before["aten._assert_tensor_metadata.default"] > 0
    stats = NormalizePass()(gm, PassContext(config=captured.config))
    gm.graph.eliminate_dead_code()
    gm.recompile()
    after = op_counts(gm)
    assert after["aten._assert_tensor_metadata.default"] == 0
    assert stats["asserts_removed"] == before["aten._assert_tensor_metadata.default"]
    assert stats["noop_casts_removed"] > 0
    assert after["aten.to.dtype"] < before["aten.to.dtype"]
    assert after["aten.linear.default"] == before["aten.linear.default"]
    batch = single_sequence_batch(T)
    torch.testing.assert_close(run_graph(gm, captured, batch), run_graph(captured.graph_module, captured, batch))


def test_paged_kv_replaces_markers_and_adds_inputs(captured) -> None:
    gm = copy.deepcopy(captured.graph_module)
    layers = captured.config.num_hidden_layers
    before_roles = graph_input_roles(gm)
    assert op_counts(gm)["kiln.attention.default"] == layers
    stats = PagedKVPass()(gm, PassContext(config=captured.config))
    gm.recompile()
    after = op_counts(gm)
    assert after["kiln.attention.default"] == 0
    assert after["kiln.paged_attention.default"] == layers
    added = [r for r in graph_input_roles(gm) if r not in before_roles]
    assert sorted(added) == sorted(
        [f"kv_cache:{i}" for i in range(layers)]
        + ["batch:slot_mapping", "batch:block_tables", "batch:seq_lens", "batch:query_start_loc"])
    assert stats == {"attention_replaced": layers, "inputs_added": layers + 4}

    # Same logits as the marker graph on one whole prefill, and K/V land in the cache.
    cfg = captured.config
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    kv = [torch.zeros(2, 4, 4, hkv, d) for _ in range(layers)]
    batch = single_sequence_batch(T)
    torch.testing.assert_close(run_graph(gm, captured, batch, kv), run_graph(captured.graph_module, captured, batch),
                               rtol=1e-5, atol=1e-5)
    assert kv[0][0, 1:3].abs().sum() > 0  # written into blocks 1-2
    assert kv[0][:, 0].abs().sum() == 0  # the null block is untouched


def test_prune_logits_selects_rows(captured) -> None:
    gm = copy.deepcopy(captured.graph_module)
    stats = PruneLogitsPass()(gm, PassContext(config=captured.config))
    gm.recompile()
    assert stats == {"lm_head_pruned": 1}
    assert "batch:logits_indices" in graph_input_roles(gm)
    assert op_counts(gm)["aten.index_select.default"] == 1
    batch = {**single_sequence_batch(T), "logits_indices": torch.tensor([1, T - 1])}
    full = run_graph(captured.graph_module, captured, batch)
    pruned = run_graph(gm, captured, batch)
    assert pruned.shape == (1, 2, captured.config.vocab_size)
    torch.testing.assert_close(pruned, full[:, [1, T - 1]])
    # Running it again is a no-op rather than a second selection.
    assert PruneLogitsPass()(gm, PassContext(config=captured.config)) == {"lm_head_pruned": 0}


def test_pass_manager_phases_dumps_and_uuids(captured, tmp_path) -> None:
    gm = copy.deepcopy(captured.graph_module)
    pm = PassManager.from_names(["prune_logits", "paged_kv", "normalize"])  # given out of order
    assert [p.name for p in pm.passes] == ["normalize", "paged_kv", "prune_logits"]
    report = pm.run(gm, PassContext(config=captured.config), dump_dir=tmp_path)
    assert [r.phase for r in report.records] == ["normalize", "attention", "logits"]
    dumps = sorted(p.name for p in tmp_path.iterdir())
    assert "00-captured.py" in dumps and "02-attention.py" in dumps and "04-logits.txt" in dumps
    assert "paged_attention" in (tmp_path / "02-attention.py").read_text()
    assert "nodes:" in (tmp_path / "04-logits.txt").read_text()
    uuids = pm.uuids()
    assert set(uuids) == {"normalize", "paged_kv", "prune_logits"} and len(set(uuids.values())) == 3


class _NoRepr:
    """A node argument FX's code generation cannot spell (its repr is not Python)."""

    def __repr__(self) -> str:
        return "<no repr>"


def _spoil_codegen(gm: torch.fx.GraphModule) -> None:
    """What a buggy pass might leave: a graph that lints but whose code does not compile."""
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.kwargs = {**node.kwargs, "spoiled": _NoRepr()}


class SpoilingPlugin(KilnPass):  # as a plugin writes it
    name = "spoiling_plugin"
    phase = "logits"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, int]:
        _spoil_codegen(gm)
        return {"spoiled": 1}


class Noop(KilnPass):
    name = "noop_plugin"
    phase = "fusion"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> dict[str, int]:
        return {}


def test_builtin_passes_generate_code_once_and_a_plugin_is_checked_alone(captured, monkeypatch) -> None:
    """The built-ins' graph code is generated once after them (a recompile is ~0.1 s a
    30-layer model: once per pass was ~0.5 s of a cold start); a plugin pass's code right
    after it, the built-ins' before it, so that an error names the pass that broke the graph."""
    import kiln.passes.manager as manager

    generated: list[list[str]] = []
    real = manager.generate_code
    monkeypatch.setattr(manager, "generate_code", lambda gm, passes: (generated.append(list(passes)), real(gm, passes)))
    names = ["normalize", "paged_kv", "prune_logits"]
    PassManager.from_names(names).run(copy.deepcopy(captured.graph_module), PassContext(config=captured.config))
    assert generated == [names]

    generated.clear()
    gm = copy.deepcopy(captured.graph_module)
    pm = PassManager(PassManager.from_names(names).passes + [Noop()])
    pm.run(gm, PassContext(config=captured.config))
    assert generated == [["normalize", "paged_kv"], ["noop_plugin"], ["prune_logits"]]
    assert "paged_attention" in gm.code and "logits_indices" in gm.code  # the code is the final graph's

    with pytest.raises(manager.PassVerificationError,
                       match=r"does not generate after pass 'spoiling_plugin': SyntaxError"):
        PassManager(PassManager.from_names(names).passes + [SpoilingPlugin()]).run(
            copy.deepcopy(captured.graph_module), PassContext(config=captured.config))


def test_a_builtin_that_breaks_codegen_is_named_with_the_passes_since_the_code_last_generated(captured, monkeypatch) -> None:
    real = PruneLogitsPass.__call__

    def spoiling(self, gm, ctx):
        stats = real(self, gm, ctx)
        _spoil_codegen(gm)
        return stats

    from kiln.passes.manager import PassVerificationError

    monkeypatch.setattr(PruneLogitsPass, "__call__", spoiling)
    with pytest.raises(PassVerificationError, match=r"does not generate after passes 'normalize', 'paged_kv', 'prune_logits': "
                                        r"SyntaxError"):
        PassManager.from_names(["normalize", "paged_kv", "prune_logits"]).run(
            copy.deepcopy(captured.graph_module), PassContext(config=captured.config))


def test_unknown_pass_and_undisableable_pass_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown pass 'nope'"):
        PassManager.from_names(["nope"])
    with pytest.raises(ValueError, match="paged_kv"):
        PassManager.default(disable=["paged_kv"])
