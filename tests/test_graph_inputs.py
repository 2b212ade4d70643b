"""The graph's calling convention (kiln.compiler.graph_inputs): role tags, the one table of
batch inputs, and `bind`. A batch input declared once in the table reaches the runner, the
bucket compiler and CUDA-graph staging without any of them being edited."""

from __future__ import annotations

import pytest
import torch

from kiln.compiler.buckets import Bucket
from kiln.compiler.graph_inputs import (
    BATCH_INPUTS, BatchInput, InputRole, RoleKind, StepInputs, add_graph_input, batch_role, bind, bucket_sizes,
    empty_step, graph_input_roles, kv_cache_role, single_prefill_step,
)
from kiln.compiler.inductor_compile import example_inputs
from kiln.compiler.pass_testing import random_weights
from kiln.compiler.pipeline import build_model_graph
from kiln.passes.weight_transforms import apply_weight_transforms
from kiln.runtime.kv_cache import allocate_kv_caches
from kiln.runtime.model_runner import ModelRunner, StepStaging, pad_step_inputs


def test_roles_parse_and_reject_unknown_kinds() -> None:
    assert InputRole.parse("kv_cache:3") == InputRole(RoleKind.KV_CACHE, "3")
    assert InputRole.parse("param:model.embed_tokens.weight").name == "model.embed_tokens.weight"
    assert kv_cache_role(2) == "kv_cache:2"
    for bad in ("weights:x", "param", "param:", "batch"):
        with pytest.raises(ValueError, match="is not one of"):
            InputRole.parse(bad)
    with pytest.raises(ValueError, match="not declared"):
        batch_role("no_such_input")


def test_bind_names_the_input_it_cannot_feed() -> None:
    roles = ["param:w", "constant:c", "kv_cache:0", "batch:seq_lens"]
    w, c, kv = torch.ones(2), torch.zeros(1), torch.zeros(3)
    assert bind(roles, params={"w": w}, constants={"c": c}, kv_caches=[kv]) == [w, c, kv, None]
    with pytest.raises(ValueError, match="'param:w' has no tensor named 'w'"):
        bind(roles, params={}, constants={"c": c}, kv_caches=[kv])
    with pytest.raises(ValueError, match="no source for constant inputs"):
        bind(roles, params={"w": w}, kv_caches=[kv])


def test_padding_follows_the_table() -> None:
    step = single_prefill_step(3, block_size=4)
    padded = pad_step_inputs(step, Bucket("tokens", num_tokens=8, num_seqs=2, num_samples=2))
    assert padded.input_ids.shape == (1, 8) and padded.slot_mapping[3:].tolist() == [0] * 5
    assert padded.query_start_loc.tolist() == [0, 3, 3]  # padded rows are empty: the last offset repeats
    assert padded.block_tables.shape == (2, 1)  # the width is dynamic: kept
    with pytest.raises(ValueError, match="does not fit bucket"):
        pad_step_inputs(step, Bucket("tokens", num_tokens=2, num_seqs=1, num_samples=1))


@pytest.fixture
def demo_input(monkeypatch: pytest.MonkeyPatch) -> BatchInput:
    """A batch input that exists only in the table (as a new pass's input would)."""
    spec = BatchInput("demo_bias", torch.int32, ("B",), pad=0, fill="ones", doc="test-only")
    monkeypatch.setitem(BATCH_INPUTS, spec.name, spec)
    return spec


def _graph_using(spec: BatchInput):
    """A real post-pass graph whose logits get `demo_bias.sum()` added: a pass that uses the input."""
    from tiny_models import tiny_config

    graph = build_model_graph(tiny_config("llama"), torch.float32, "cpu")
    gm = graph.graph_module
    demo = add_graph_input(gm, spec.name, batch_role(spec.name))
    out = next(iter(gm.graph.find_nodes(op="output")))
    logits = out.args[0]
    with gm.graph.inserting_before(out):
        total = gm.graph.call_function(torch.ops.aten.sum.default, (demo,))
        shifted = gm.graph.call_function(torch.ops.aten.add.Tensor, (logits, total))
    out.args = (shifted,)
    gm.recompile()
    return graph


def test_a_new_batch_input_reaches_runner_compiler_and_staging(demo_input: BatchInput) -> None:
    graph = _graph_using(demo_input)
    captured, gm = graph.captured, graph.graph_module
    roles = graph_input_roles(gm)
    assert roles[-1] == "batch:demo_bias"

    # The runner binds it per step from the step's inputs (here its empty-step value, ones).
    config = captured.config
    kv = allocate_kv_caches(config.num_hidden_layers, 4, 16, config.num_key_value_heads,
                            config.hidden_size // config.num_attention_heads, torch.float32, torch.device("cpu"))
    weights = apply_weight_transforms(random_weights(captured), graph.weight_transforms)
    runner = ModelRunner(gm, roles, weights, captured.constants, kv, torch.device("cpu"))
    step = single_prefill_step(5, 16, input_ids=torch.arange(5))
    assert step["demo_bias"].tolist() == [1]
    base = runner.execute(step)
    step["demo_bias"] = torch.tensor([3], dtype=torch.int32)
    torch.testing.assert_close(runner.execute(step) - base, torch.full_like(base, 2.0))

    # The bucket compiler builds an example of it at the bucket's shape.
    bucket = Bucket("decode", num_tokens=4, num_seqs=4, num_samples=4)
    args, dynamic = example_inputs(gm, roles, captured.constants, config, bucket, torch.float32,
                                   torch.device("cpu"), 16)
    assert args[-1].shape == (4,) and args[-1].dtype == torch.int32 and dynamic[-1] is None

    # CUDA-graph staging gives it a buffer, packed with the other int32 inputs, and uploads it.
    staging = StepStaging.allocate(bucket, 8, torch.device("cpu"))
    assert staging.device["demo_bias"].tolist() == [1, 1, 1, 1]
    padded = pad_step_inputs(StepInputs(empty_step(bucket_sizes(1, 1, 1, 2)), demo_bias=torch.tensor([5], dtype=torch.int32)), bucket)
    staging.upload(padded)
    assert staging.device["demo_bias"].tolist() == [5, 0, 0, 0]
    assert staging.device["demo_bias"].untyped_storage().data_ptr() == staging.device["seq_lens"].untyped_storage().data_ptr()


def test_the_memory_profile_step_stays_inside_the_context() -> None:
    """A model with learned absolute positions indexes its position embedding with the step's
    positions: the profiled step (max_num_batched_tokens, larger than max_model_len here) must
    not ask for positions past it (on CUDA that was a device-side assert at start-up)."""
    from kiln.runtime.kv_cache import profile_step

    step = profile_step(2048, 16, max_model_len=128)
    assert step.position_ids.shape == (1, 2048) and int(step.position_ids.max()) == 127
    assert step.slot_mapping.eq(0).all() and step.block_tables.eq(0).all()  # everything in the null block
