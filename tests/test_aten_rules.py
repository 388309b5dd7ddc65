"""Facts declared on the ATen rules (``keep``, ``fresh``) and the rules' LoweringContext."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.backends.reference import run_graph
from kiln.frontends.torch import aten as aten_rules
from kiln.frontends.torch.aten import ATEN_TABLE, LoweringContext, is_fresh, kept_ops, lowers
from kiln.frontends.torch.capture import (
    capture_program,
    decomposition_table,
    export_program,
    is_undecomposed,
    lowering_blockers,
)
from kiln.ir import DType, Graph, TensorType, Value
from kiln.ir.builder import GraphBuilder

aten = torch.ops.aten

# The two lists these facts replaced, as they stood: ATen ops kept whole instead of
# decomposed, and op packets whose result never shares memory with an operand.
OLD_KEPT_OPS = (
    "silu.default", "layer_norm.default", "rms_norm.default", "softmax.int", "log_softmax.int",
    "scaled_dot_product_attention.default", "upsample_nearest2d.default",
    "upsample_nearest2d.vec", "upsample_bilinear2d.vec", "matmul.default", "linear.default",
    "tril.default", "triu.default", "adaptive_avg_pool2d.default", "max_pool2d.default",
    "masked_fill.Scalar", "masked_fill.Tensor", "native_dropout.default", "group_norm.default",
    "native_group_norm.default", "roll.default", "diagonal.default", "unfold.default",
    "rot90.default", "diag.default", "diag_embed.default", "take_along_dim.default",
    "upsample_nearest1d.vec", "upsample_nearest3d.vec", "_upsample_nearest_exact1d.vec",
    "_upsample_nearest_exact2d.vec", "_upsample_nearest_exact3d.vec", "upsample_linear1d.vec",
    "upsample_bicubic2d.vec", "upsample_trilinear3d.vec",
    "_scaled_dot_product_flash_attention_for_cpu.default", "detach.default",
    "special_log_ndtr.default",
)
OLD_FRESH_PACKETS = (
    "conv1d", "conv2d", "conv3d", "convolution", "batch_norm", "layer_norm", "group_norm",
    "linear", "addmm", "mm", "bmm", "add", "sub", "rsub", "mul", "div", "neg", "relu",
    "gelu", "silu", "sigmoid", "tanh", "hardtanh", "leaky_relu", "clamp", "exp", "pow",
    "where", "clone", "cat", "max_pool2d", "avg_pool2d", "max_pool3d", "avg_pool3d",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "embedding",
    "scaled_dot_product_attention", "softmax", "log_softmax",
)


def _op(name: str):
    packet, overload = name.split(".")
    return getattr(getattr(aten, packet), overload)


# ------------------------------------------------------------------------- keep
def test_every_formerly_kept_op_is_declared_kept():
    missing = [name for name in OLD_KEPT_OPS if _op(name) not in kept_ops()]
    assert not missing


def test_the_decomposition_table_is_unchanged():
    """core ATen minus exactly the old list: no op is kept whole that was decomposed before."""
    old = {_op(name) for name in OLD_KEPT_OPS}
    expected = {op for op in torch.export.default_decompositions() if op not in old}
    assert set(decomposition_table()) == expected


def test_a_keep_declaration_takes_the_op_out_of_the_table(monkeypatch):
    op = aten.hardsigmoid.default
    assert op in decomposition_table()  # decomposed by default
    rule = ATEN_TABLE.get(op) or aten_rules.AtenRule(lambda ctx, x: x)
    monkeypatch.setitem(ATEN_TABLE, op, aten_rules.AtenRule(rule.lower, rule.check, keep=True))
    assert op in kept_ops() and op not in decomposition_table()


# ------------------------------------------------------------------------ fresh
def test_every_formerly_fresh_op_is_declared_fresh():
    """Every overload kiln lowers of each packet of the old list is fresh."""
    not_fresh, covered = [], set()
    for op in ATEN_TABLE:
        packet = getattr(op, "overloadpacket", None)
        if packet is not None and packet.__name__ in OLD_FRESH_PACKETS:
            covered.add(packet.__name__)
            if not is_fresh(op):
                not_fresh.append(str(op))
    assert not not_fresh
    assert covered == set(OLD_FRESH_PACKETS)


@pytest.mark.parametrize("op", [
    aten.view.default, aten.t.default, aten.alias.default, aten.expand.default,
    aten.permute.default, aten.slice.Tensor, aten.contiguous.default, aten._unsafe_view.default,
    aten.dropout.default,  # eval mode returns its input itself, with no alias annotation
    aten.type_as.default,  # returns its input when the dtype already matches
    aten.relu_.default, aten.add_.Tensor,  # in-place: the result is the operand
    aten.hardsigmoid.default,  # no kiln rule: nothing is known
])
def test_aliasing_and_unknown_ops_are_not_fresh(op):
    assert not is_fresh(op)


def test_every_fresh_declaration_agrees_with_the_schema():
    for op, rule in ATEN_TABLE.items():
        if rule.fresh:
            schema = op._schema
            assert not schema.is_mutable, op
            assert all(r.alias_info is None for r in schema.returns), op


@pytest.mark.parametrize("op, why", [
    (aten.t.default, "aliases"),
    (aten.view.default, "aliases"),
    (aten.relu_.default, "writes one of its arguments"),
])
def test_a_fresh_declaration_contradicting_the_schema_is_refused(op, why):
    before = ATEN_TABLE.get(op)
    with pytest.raises(ValueError, match=why):
        lowers(op, fresh=True)
    assert ATEN_TABLE.get(op) is before


class _InplaceOnAbs(torch.nn.Module):
    def forward(self, x):
        h = x.abs()  # abs is one of the elementwise ops declared fresh as a family
        torch.relu_(h)
        return h * 2


def test_inplace_write_to_a_fresh_elementwise_result_is_lowered_whole():
    x = torch.linspace(-2, 2, 12).reshape(3, 4)
    program = export_program(_InplaceOnAbs(), (x,))
    assert is_undecomposed(program), lowering_blockers(program)
    captured = capture_program(program)
    (got,) = run_graph(captured.graph, [x.numpy()], [])
    np.testing.assert_allclose(got, _InplaceOnAbs()(x).numpy())


# ------------------------------------------------------------- LoweringContext
def _context() -> tuple[Graph, LoweringContext, Value]:
    graph = Graph("g")
    x = graph.add_input("x", TensorType((2,), DType.uint8))
    node = torch.fx.Graph().placeholder("x")
    node.meta["val"] = torch.zeros(2, dtype=torch.uint8)
    ctx = LoweringContext(graph, node, "model.py:3 in forward: y = x + 1")
    return graph, ctx, x


def test_lowering_context_is_a_graph_builder():
    graph, ctx, x = _context()
    assert isinstance(ctx, GraphBuilder)
    y = ctx.add(x, ctx.const(1, x))  # the base class's helpers
    assert y.producer.loc == "model.py:3 in forward: y = x + 1"
    assert ctx.created == [y.producer]
    assert ctx.aten_node.name == "x" and ctx.out == TensorType((2,), DType.uint8)


def test_lowering_context_const_wraps_integers_as_torch_does():
    graph, ctx, x = _context()
    assert int(ctx.const(256, DType.uint8).data) == 0
    assert int(ctx.const(-1, x).data) == 255  # a value's dtype
    with pytest.raises(OverflowError):
        GraphBuilder(graph).const(256, DType.uint8)  # the base refuses what torch wraps
    assert ctx.cast(x, None) is x and ctx.cast(x, DType.uint8) is x
    assert ctx.reshape(x, torch.Size([2])) is x
