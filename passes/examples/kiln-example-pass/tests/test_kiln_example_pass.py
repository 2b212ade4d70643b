"""The example pass as before graph -> after graph, plus its kernel against its reference.

Self-contained on purpose (no fixtures from Kiln's own tests), so it is a template for an
out-of-tree pass package: run with `python -m pytest passes/examples/kiln-example-pass/tests`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

from kiln.passes import op_counts
from kiln.compiler.graph_inputs import graph_input_roles
from kiln.compiler.pass_testing import graph_for_pass, run_graph

from kiln_example_pass import GELU_TANH_AND_MUL, FuseGeluTanhAndMul, gelu_tanh_and_mul_reference

FUSED_OP = "kiln_example.gelu_tanh_and_mul.default"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def gelu_llama() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**TINY, hidden_act="gelu_pytorch_tanh")


PASS = "fuse_gelu_tanh_and_mul"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cpu_fusions", [False, True], ids=["cpu-policy", "cuda-policy"])
def test_fuses_every_mlp_and_keeps_the_logits(dtype: torch.dtype, cpu_fusions: bool) -> None:
    """On the graph the pass receives in the engine's pipeline: after merge_gate_up, and (with
    the built-in fusions on, as on CUDA) after fuse_rmsnorm too. Kiln's built-in fuse_silu_mul
    now fuses GELU-tanh-and-mul as well, so on the CUDA pipeline it is disabled here to give
    this example pass something to do (test_the_builtin_takes_the_pattern_first checks the
    overlap is reported)."""
    config = gelu_llama()
    before = graph_for_pass(config, PASS, dtype=dtype, cpu_fusions=cpu_fusions,
                            disable=["fuse_silu_mul"] if cpu_fusions else [])
    assert {"merge_gate_up", "fuse_rmsnorm"} <= set(before.pipeline)  # its phase's built-ins ran first
    after = before.copy()
    counts_before = op_counts(before.graph_module)
    assert counts_before["aten.gelu.default"] == config.num_hidden_layers
    assert counts_before[FUSED_OP] == 0
    assert (counts_before["kiln.rms_norm.default"] > 0) is cpu_fusions

    stats = after.run_pass(FuseGeluTanhAndMul())

    counts_after = op_counts(after.graph_module)
    assert stats == {"gelu_tanh_and_mul": config.num_hidden_layers}
    assert counts_after["aten.gelu.default"] == 0
    assert counts_after[FUSED_OP] == config.num_hidden_layers
    assert counts_after["aten.mul.Tensor"] == counts_before["aten.mul.Tensor"] - config.num_hidden_layers
    fused = next(iter(after.graph_module.graph.find_nodes(op="call_function", target=torch.ops.kiln_example.gelu_tanh_and_mul.default)))
    assert fused.meta["val"].dtype == dtype  # later passes can read the new node's shape and dtype
    # gate and up are slices of the merged gate/up projection: run_graph merges the weights
    # as the loader does. On CPU the fused op runs its reference, which rounds exactly like
    # the unfused ops.
    assert "param:model.layers.0.mlp.gate_up_proj.weight" in graph_input_roles(after.graph_module)
    assert torch.equal(run_graph(after), run_graph(before))


def test_leaves_a_silu_model_alone() -> None:
    config = transformers.LlamaConfig(**TINY)  # hidden_act="silu"
    graph = graph_for_pass(config, PASS)
    code_before = graph.graph_module.code
    stats = graph.run_pass(FuseGeluTanhAndMul())
    assert stats == {"gelu_tanh_and_mul": 0}
    assert graph.graph_module.code == code_before
    report = GELU_TANH_AND_MUL.explain(graph.graph_module, dtype=torch.float32)
    assert not report.matched and "aten.gelu.default" in report.missing_ops


def test_broadcasting_multiply_is_not_fused() -> None:
    """The `where` filter: the fused op takes equal shapes only."""
    from kiln.passes.pattern import trace_function

    def mlp_tail(gate: torch.Tensor, up_row: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(gate, approximate="tanh") * up_row

    gm = trace_function(mlp_tail, [torch.randn(4, 32), torch.randn(1, 32)])
    assert GELU_TANH_AND_MUL.apply(gm) == 0
    gm = trace_function(mlp_tail, [torch.randn(4, 32), torch.randn(4, 32)])
    assert GELU_TANH_AND_MUL.apply(gm) == 1


def test_triton_kernel_matches_reference_in_the_interpreter() -> None:
    """The Triton kernel on CPU tensors (TRITON_INTERPRET=1 must be set before Triton loads,
    hence a fresh interpreter)."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import torch
        from kiln_example_pass.ops import gelu_tanh_and_mul_reference
        from kiln_example_pass.triton_ops import gelu_tanh_and_mul_triton
        g = torch.Generator().manual_seed(0)
        for shape in [(3, 37), (2, 5, 1100), (1,)]:
            for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
                gate = (torch.randn(shape, generator=g) * 3).to(dtype)
                up = torch.randn(shape, generator=g).to(dtype)
                out = gelu_tanh_and_mul_triton(gate, up)
                ref = gelu_tanh_and_mul_reference(gate, up)
                assert out.shape == ref.shape and out.dtype == dtype
                torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_matches_reference() -> None:
    from kiln_example_pass.ops import CUDA_KERNEL_REGISTERED

    assert CUDA_KERNEL_REGISTERED
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape, dtype, tol in [((512, 8192), torch.bfloat16, 2e-2), ((7, 1000), torch.float32, 1e-5)]:
        gate = torch.randn(shape, generator=g, device="cuda").to(dtype) * 3
        up = torch.randn(shape, generator=g, device="cuda").to(dtype)
        out = torch.ops.kiln_example.gelu_tanh_and_mul(gate, up)
        torch.testing.assert_close(out.float(), gelu_tanh_and_mul_reference(gate, up).float(), atol=tol, rtol=tol)


def test_the_builtin_takes_the_pattern_first() -> None:
    """With the built-in fusions on (CUDA), fuse_silu_mul fuses GELU-tanh-and-mul before this
    plugin runs: the plugin matches nothing, and the manager says which pass consumed it."""
    config = gelu_llama()
    before = graph_for_pass(config, PASS, cpu_fusions=True)
    stats = before.copy().run_pass(FuseGeluTanhAndMul())
    assert stats == {"gelu_tanh_and_mul": 0}
    assert op_counts(before.graph_module)["kiln.gelu_tanh_and_mul.default"] == config.num_hidden_layers
