"""The README's support table is what `tests/support_table.py` generates, and Kiln refuses
each unsupported architecture naming the construct (not the architecture)."""

from __future__ import annotations

import pytest
from support_table import README, Row, parse_rows, readme_table, refusal, render
from tiny_models import REFUSED, SUPPORTED, exercises, refusal_construct, tiny_config

from kiln.compiler.capture import UnsupportedArchitectureError, capture


def test_readme_table_is_generated() -> None:
    table = readme_table(README.read_text())
    rows = parse_rows(table)
    assert [r.arch for r in rows] == list(SUPPORTED) + list(REFUSED)
    # The fusion column is checked per architecture against the real graph by
    # test_fusions_per_arch.py; everything else is regenerated here.
    fusions = {r.arch: r.fusions for r in rows}
    expected = [Row(a, "passes", exercises(a), fusions[a]) for a in SUPPORTED]
    expected += [Row(a, "refused", refusal(a), "-") for a in REFUSED]
    assert table == render(expected), "README's support table is stale: run tests/support_table.py --write"
    assert len({tiny_config(a).model_type for a in SUPPORTED}) >= 30


@pytest.mark.parametrize("arch", REFUSED)
def test_refusal_names_the_construct(arch: str) -> None:
    with pytest.raises(UnsupportedArchitectureError) as info:
        capture(tiny_config(arch))
    message = str(info.value)
    assert refusal_construct(arch) in message
    # Named by construct and place, not by architecture name.
    assert arch not in message.split("(")[0].lower()


def test_experts_looping_over_their_tokens_are_refused_unless_rebuilt(monkeypatch) -> None:
    """Experts whose code loops over the tokens each one got (DBRX's, as transformers writes
    them) make shapes depend on tensor values; capture names that, and DBRX runs only because
    its experts are rebuilt as batched_mm ones (kiln.compiler.stacked_experts)."""
    from kiln.compiler import stacked_experts

    monkeypatch.setattr(stacked_experts, "LOOPED_EXPERTS", {})
    with pytest.raises(UnsupportedArchitectureError, match="shapes that depend on tensor values "
                                                           r"\(modeling_dbrx\.py"):
        capture(tiny_config("dbrx"))


def test_remote_code_model_is_refused() -> None:
    """A model_type that only the repo's own code defines is refused; one that transformers
    ships is captured from transformers' code even where the repo carries its own (`auto_map`,
    as DeepSeek-V3's does)."""
    config = tiny_config("llama")
    config.auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    assert capture(config).graph_module.graph.nodes
    config.model_type = "custom_llama"
    with pytest.raises(UnsupportedArchitectureError, match="trust_remote_code model"):
        capture(config)


def test_attention_argument_kiln_cannot_honour_is_refused() -> None:
    # An attention module handing the attention function a relative position bias (T5's
    # position_bias): the marker has no such argument, so capture refuses instead of
    # dropping it. Attention sinks (GPT-OSS's s_aux) it carries, one per query head: sinks
    # of another shape are refused likewise.
    import torch

    from kiln.compiler.capture import _kiln_attention_forward

    module = torch.nn.Module()
    module.layer_idx = 0
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(UnsupportedArchitectureError, match="relative position bias"):
        _kiln_attention_forward(module, q, q, q, None, scaling=0.5, position_bias=torch.zeros(1, 2, 3, 3))
    with pytest.raises(UnsupportedArchitectureError, match=r"attention sinks of shape \(3,\) for 2 query heads"):
        _kiln_attention_forward(module, q, q, q, None, scaling=0.5, s_aux=torch.zeros(3))


def test_unknown_tensor_argument_to_attention_is_refused() -> None:
    # A tensor the attention function would compute with, which the marker has no slot for.
    import torch

    from kiln.compiler.capture import _kiln_attention_forward

    module = torch.nn.Module()
    module.layer_idx = 0
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(UnsupportedArchitectureError, match="attention argument.*'token_type_bias'"):
        _kiln_attention_forward(module, q, q, q, None, scaling=0.5, token_type_bias=torch.zeros(3))


def test_kv_cache_shape_mismatch_is_caught_at_compile_time() -> None:
    # A multi-query config that also claims two KV heads: the cache would be sized for two
    # while each layer's k has one. The paged-KV pass names the layer instead of letting the
    # runtime write a wrongly shaped cache.
    import torch

    from kiln.compiler.pipeline import build_model_graph

    config = tiny_config("gpt_bigcode")
    config.num_key_value_heads = 2
    with pytest.raises(ValueError, match=r"paged_kv: layer 0 has \(1, 16\) KV heads x head_dim.*\(2, 16\)"):
        build_model_graph(config, torch.float32, "cpu")


def test_token_count_bound_of_an_export_is_read() -> None:
    """Capture lets export narrow the token count's range (Llama 4: from 2 up), but refuses a
    model whose code bounds it below the tokens a step packs: the bound it reads is this."""
    import torch
    from torch.export import Dim

    from kiln.compiler.capture import _token_count_upper_bound

    class Sliced(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.arange(64.0))

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return input_ids * self.table[: input_ids.shape[1]]

    ids = torch.ones(1, 8)
    bounded = torch.export.export(Sliced(), (ids,), dynamic_shapes={"input_ids": {1: Dim("t", min=1, max=64)}})
    assert _token_count_upper_bound(bounded) == 64
    free = torch.export.export(torch.nn.Flatten(0), (ids,), dynamic_shapes=({1: Dim.DYNAMIC},))
    assert _token_count_upper_bound(free) is None


def test_input_free_computations_become_constants() -> None:
    """What a graph computes from no input (PhiMoE's RoPE recomputes inv_freq with an `arange`
    on the CPU in every forward) is computed once at capture and read as a constant input: a
    CUDA graph cannot capture the step's host-to-device copy. Random and uninitialised ops are
    never folded, nor is anything that reads an input."""
    import torch

    from kiln.compiler.capture import _fold_input_free_computations, capture
    from kiln.compiler.graph_inputs import INPUT_META_KEY

    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            table = torch.arange(4, dtype=torch.float32) * 2.0       # folded
            noise = torch.rand(4)                                     # random: kept
            scratch = torch.empty(4).fill_(1.0)                       # uninitialised: kept
            return x * table + noise * 0 + scratch + x.sum()

    gm = torch.export.export(Model(), (torch.ones(4),)).module()
    gm = torch.fx.symbolic_trace(gm) if not isinstance(gm, torch.fx.GraphModule) else gm
    for node in gm.graph.find_nodes(op="placeholder"):
        node.meta[INPUT_META_KEY] = "batch:x"
    constants: dict[str, torch.Tensor] = {}
    assert _fold_input_free_computations(gm, constants) == 1
    torch.testing.assert_close(constants["folded_0"], torch.arange(4.0) * 2)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "aten.arange.start_step" not in targets and "aten.arange.default" not in targets
    assert any("rand" in t for t in targets) and any("empty" in t for t in targets)

    phimoe = capture(tiny_config("phimoe"))
    assert {k for k in phimoe.constants if k.startswith("folded")} == {"folded_0", "folded_1"}
    assert not phimoe.graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.to.device)
