"""`kiln.passes.inline_attention`: attention a model writes inline, before -> after.

Before: softmax(q @ k^T * scale + bias (+ mask)) @ v, or an SDPA call with a model-built mask.
After: one `kiln::attention` marker per layer, the scale, window and ALiBi slopes read off the
graph; nothing of the softmax or the bias subgraph left. Toy modules show each construct the
pass must read (ALiBi, a sliding window) or refuse (a learned bias, a bidirectional mask,
soft-capping written inline); the real Bloom, MPT and Falcon graphs show the slopes equal
their own formulas. End-to-end parity with Hugging Face is in test_parity.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_config

from kiln.compiler.capture import capture
from kiln.compiler.graph_inputs import INPUT_META_KEY, batch_role, constant_role, param_role
from kiln.passes.inline_attention import InlineAttentionError, mark_inline_attention

HEADS, HEAD_DIM, VOCAB = 4, 8, 32
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


class ToyAttention(torch.nn.Module):
    """One attention layer written inline; `logits(scores, positions)` is what varies."""

    def __init__(self, logits):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HEADS * HEAD_DIM)
        self.qkv = torch.nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM)
        self.learned = torch.nn.Parameter(torch.zeros(HEADS, 1, 1))
        self.logits = logits

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        q, k, v = self.qkv(self.embed(input_ids)).view(1, t, 3, HEADS, HEAD_DIM).unbind(2)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        scores = self.logits(self, q @ k.transpose(-1, -2), position_ids[0])
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return (probs @ v).transpose(1, 2).reshape(1, t, -1)


def causal_mask(positions: torch.Tensor, window: int = 0) -> torch.Tensor:
    allowed = positions[None, :] <= positions[:, None]
    if window:
        allowed = allowed & (positions[None, :] > positions[:, None] - window)
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)


def alibi_logits(module, scores, positions):
    # Bloom's form: slope * key position (no query term), plus the causal mask.
    return scores * 0.3 + SLOPES[:, None, None] * positions[None, None, :] + causal_mask(positions)


def windowed_logits(module, scores, positions):
    return scores * 0.3 + causal_mask(positions, window=5)


def mask_then_scale_logits(module, scores, positions):
    # CodeGen's form in transformers 5.17: the mask added before the division by the scale,
    # which takes the masked logits up to min / sqrt(head_dim).
    return (scores + causal_mask(positions)) / (1 / 0.3)


def learned_bias_logits(module, scores, positions):
    return scores * 0.3 + module.learned + causal_mask(positions)


def bidirectional_logits(module, scores, positions):
    return scores * 0.3


def softcapped_logits(module, scores, positions):
    return torch.tanh(scores * 0.3 / 2.0) * 2.0 + causal_mask(positions)


def export_toy(logits) -> tuple[torch.fx.GraphModule, ToyAttention, dict[str, torch.Tensor]]:
    """The toy exported as capture exports a model: T dynamic, inputs tagged by role, its
    constant tensors (the slopes) returned as capture returns them."""
    from torch.export import Dim

    module = ToyAttention(logits).eval()
    t = Dim("num_tokens", min=1, max=1024)
    ids, pos = torch.zeros((1, 8), dtype=torch.long), torch.arange(8)[None]
    program = torch.export.export(module, (ids, pos), dynamic_shapes={"input_ids": {1: t}, "position_ids": {1: t}},
                                  strict=False)
    gm = program.graph_module
    constants: dict[str, torch.Tensor] = {}
    for node, spec in zip(gm.graph.find_nodes(op="placeholder"), program.graph_signature.input_specs):
        if spec.kind.name == "PARAMETER":
            node.meta[INPUT_META_KEY] = param_role(spec.target)
        elif spec.kind.name == "CONSTANT_TENSOR":
            constants[spec.target] = program.constants[spec.target]
            node.meta[INPUT_META_KEY] = constant_role(spec.target)
        else:
            node.meta[INPUT_META_KEY] = batch_role(spec.arg.name)
    return gm, module, constants


def run(gm: torch.fx.GraphModule, module: ToyAttention, constants: dict[str, torch.Tensor], t: int) -> torch.Tensor:
    params = dict(module.named_parameters())
    args = []
    for node in gm.graph.find_nodes(op="placeholder"):
        kind, _, name = node.meta[INPUT_META_KEY].partition(":")
        args.append({"param": lambda: params[name], "constant": lambda: constants[name],
                     "batch": lambda: (torch.arange(t) % VOCAB)[None] if name == "input_ids"
                     else torch.arange(t)[None]}[kind]())
    with torch.no_grad():
        out = gm(*args)
    return out[0] if isinstance(out, (tuple, list)) else out


def markers(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=torch.ops.kiln.attention.default))


@pytest.mark.parametrize("logits,window,alibi", [(alibi_logits, 0, True), (windowed_logits, 5, False),
                                                 (mask_then_scale_logits, 0, False)])
def test_inline_attention_becomes_the_marker(logits, window, alibi):
    gm, module, constants = export_toy(logits)
    before = run(gm, module, constants, 13)

    report = mark_inline_attention(gm, constants)

    (marker,) = markers(gm)
    q, k, v, layer_idx, scale, marker_window, softcap, *slopes = marker.args
    assert (layer_idx, marker_window, softcap) == (0, window, 0.0)
    assert scale == pytest.approx(0.3, rel=1e-6)
    assert report.sites == 1 and report.alibi_layers == int(alibi)
    if alibi:
        torch.testing.assert_close(constants["alibi_slopes"], SLOPES)
        assert slopes[0].meta[INPUT_META_KEY] == "constant:alibi_slopes"
    else:
        assert not slopes and "alibi_slopes" not in constants
    remaining = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not remaining & {torch.ops.aten.softmax.int, torch.ops.aten.where.ScalarOther}
    # Same values as the inline form, at a length other than the probe's and the export's.
    torch.testing.assert_close(run(gm, module, constants, 13), before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("logits,construct", [
    (learned_bias_logits, "learned attention bias"),
    (bidirectional_logits, "bidirectional attention"),
    (softcapped_logits, "non-linear transform"),
])
def test_what_the_marker_cannot_carry_is_refused_by_construct(logits, construct):
    gm, _, constants = export_toy(logits)
    with pytest.raises(InlineAttentionError, match=construct):
        mark_inline_attention(gm, constants)


def test_config_window_missing_from_the_mask_is_refused():
    gm, _, constants = export_toy(alibi_logits)
    with pytest.raises(InlineAttentionError, match="sliding window"):
        mark_inline_attention(gm, constants, config_sliding_window=4096)


def bloom_slopes(heads: int) -> torch.Tensor:
    """ALiBi's slopes as the paper (and Bloom) define them, for any head count."""
    closest = 2 ** math.floor(math.log2(heads))
    base = [2 ** (-8 * (i + 1) / closest) for i in range(closest)]
    extra = [2 ** (-4 * (2 * i + 1) / closest) for i in range(heads - closest)]
    return torch.tensor(base + extra)


def mpt_slopes(heads: int, bias_max: float = 8.0) -> torch.Tensor:
    pow2 = 2 ** math.ceil(math.log2(heads))
    slopes = [1.0 / 2 ** ((i + 1) * bias_max / pow2) for i in range(pow2)]
    return torch.tensor((slopes[1::2] + slopes[::2])[:heads] if pow2 != heads else slopes)


@pytest.mark.parametrize("arch,expected", [
    ("bloom", lambda c: bloom_slopes(c.n_head)),
    ("mpt", lambda c: mpt_slopes(c.n_heads)),
    # Falcon-RW folds ALiBi / sqrt(head_dim) into its SDPA mask.
    ("falcon_rw", lambda c: bloom_slopes(c.num_attention_heads) / math.sqrt(c.hidden_size // c.num_attention_heads)),
    ("falcon", None),
])
def test_real_models_slopes_match_their_formulas(arch, expected):
    config = tiny_config(arch)
    captured = capture(config)
    found = markers(captured.graph_module)
    assert len(found) == config.num_hidden_layers
    assert [m.args[3] for m in found] == list(range(config.num_hidden_layers))
    assert not captured.graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.softmax.int)
    if expected is None:
        # No alibi_slopes argument (the marker's eighth). Falcon's rotary models are inline up
        # to transformers 5.24 and call the attention-function interface from 5.25.
        assert all(len(m.args) <= 7 for m in found) and "alibi_slopes" not in captured.constants
    else:
        torch.testing.assert_close(captured.constants["alibi_slopes"], expected(config).float(), rtol=1e-6, atol=0)
