"""Facts passes read from the op declarations instead of lists of op names.

Pins the traits ``nonnegative`` (simplify), ``copy`` and ``replayable`` (remat),
``whole_view`` (sink-views) and the ``axes=`` form of attribute schemas (canonicalize) to the
ops that carry them, and checks that an op declared outside kiln gets the same treatment
from the same declaration.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import kiln.ir as ir
from kiln.ir import Attr, DType, Graph, OpDef, TensorType, builtin_ops, defop, registry
from kiln.passes.canonicalize import Canonicalize, axis_attrs
from kiln.passes.remat import is_recomputable
from kiln.passes.simplify import Simplify, provably_nonnegative
from kiln.passes.sink_views import SinkViews

F32 = DType.float32

# The op-name lists the passes kept before these facts moved onto the declarations.
# rsqrt left the list: rsqrt(-0.0) is -inf (see test_exp_of_log_keeps_rsqrt_of_negative_zero).
OLD_NONNEGATIVE = {"exp", "sigmoid", "relu", "abs", "sqrt", "softmax"}
OLD_COPY = {"cat", "pad", "flip", "tril", "triu", "repeat", "cast"}
OLD_REPLAYABLE = {"dropout_mask"}
OLD_SINKABLE = {"permute", "reshape", "expand"}
OLD_AXIS_ATTRS = {
    **{name: ("dims", "set") for name in ("sum", "mean", "amax", "amin", "prod", "var", "any", "all")},
    "flip": ("dims", "set"),
    "permute": ("dims", "seq"),
    "index": ("dims", "seq"),
    **{name: ("dim", "axis") for name in (
        "argmax", "argmin", "cumsum", "softmax", "log_softmax", "slice", "select", "cat",
        "gather", "index_select")},
}
OLD_AXIS_ATTRS |= {"all_gather": ("dim", "axis"), "reduce_scatter": ("dim", "axis"),
                   "all_to_all": ("split_dim", "axis")}  # the collectives (kiln/ir/ops/collectives.py)


def _with_trait(trait: str) -> set[str]:
    return {name for name, d in builtin_ops().items() if d.has(trait)}


@pytest.mark.parametrize("trait, old", [("nonnegative", OLD_NONNEGATIVE), ("copy", OLD_COPY),
                                        ("replayable", OLD_REPLAYABLE), ("whole_view", OLD_SINKABLE)])
def test_each_trait_is_carried_by_exactly_the_ops_of_the_old_list(trait, old):
    assert _with_trait(trait) == old


def test_replayable_ops_are_random_and_whole_views_are_views():
    assert all(builtin_ops()[n].has("random") for n in _with_trait("replayable"))
    assert all(builtin_ops()[n].has("view") for n in _with_trait("whole_view"))


def test_the_axis_table_derived_from_the_schemas_is_the_old_table():
    builtin = builtin_ops()
    derived = {name: forms for name, forms in axis_attrs().items() if name in builtin}
    assert derived == {name: {key: form} for name, (key, form) in OLD_AXIS_ATTRS.items()}


def test_every_trait_of_a_builtin_op_is_documented_on_opdef():
    source = inspect.getsource(OpDef)
    used = set().union(*(d.traits for d in builtin_ops().values()))
    assert {t for t in used if f"``{t}``" not in source} == set()


@pytest.mark.parametrize("kind, axes", [("int", "set"), ("int", "seq"), ("ints", "axis"),
                                        ("float", "axis"), ("ints", "dims")])
def test_attr_axes_forms_are_validated(kind, axes):
    with pytest.raises(ValueError, match="axes="):
        Attr(kind, axes=axes)


def test_attr_axes_forms_are_accepted_on_their_kinds():
    assert Attr("int", axes="axis").axes == "axis"
    assert Attr("ints", (), axes="set").axes == "set"
    assert Attr("ints", axes="seq").axes == "seq"
    assert Attr("ints").axes is None


# --------------------------------------------------- ops declared outside kiln: same treatment
@pytest.fixture
def scratch_op():
    names = []

    def declare(name, **kw):
        defop(name, **kw)(lambda x, **attrs: x)
        names.append(name)
        return name

    yield declare
    for name in names:
        registry._REGISTRY.pop(name, None)


def _same(types, **attrs):
    return types[0]


def test_canonicalize_normalizes_axes_of_any_op_declaring_them(scratch_op):
    name = scratch_op("test_op_facts.axes", infer=_same, attrs={
        "dim": Attr("int", axes="axis"), "order": Attr("ints", axes="seq"),
        "dims": Attr("ints", axes="set"), "other": Attr("ints", ())})
    g = Graph("a")
    x = g.add_input("x", TensorType((2, 3, 4), F32))
    g.set_outputs([g.op(name, x, dim=-1, order=(-1, 0), dims=(-1, 0, 2), other=(-1,))])
    out = Canonicalize().run(g)
    assert out.changed
    assert dict(out.graph.outputs[0].producer.attrs) == {
        "dim": 2, "order": (2, 0), "dims": (0, 2), "other": (-1,)}
    assert "test_op_facts.axes" in axis_attrs()


def _exp_of_log(name: str) -> Graph:
    g = Graph("e")
    x = g.add_input("x", TensorType((4,), F32))
    g.set_outputs([g.op("exp", g.op("log", g.op(name, x)))])
    return g


@pytest.mark.parametrize("traits, drops", [(("elementwise", "nonnegative"), True), (("elementwise",), False)])
def test_simplify_trusts_the_nonnegative_trait(scratch_op, traits, drops):
    name = scratch_op(f"test_op_facts.nonneg{len(traits)}", infer=_same, traits=traits)
    g = _exp_of_log(name)
    assert provably_nonnegative(g.outputs[0].producer.inputs[0].producer.inputs[0]) is drops
    out = Simplify().run(g).graph
    assert [n.op_name for n in out.nodes] == ([name] if drops else [name, "log", "exp"])


@pytest.mark.parametrize("traits, recomputable", [(("copy",), True), ((), False)])
def test_remat_recomputes_copy_ops(scratch_op, traits, recomputable):
    name = scratch_op(f"test_op_facts.copy{len(traits)}", infer=_same, traits=traits)
    g = Graph("c")
    x = g.add_input("x", TensorType((4,), F32))
    g.set_outputs([g.op(name, x)])
    assert is_recomputable(g.outputs[0].producer) is recomputable


@pytest.mark.parametrize("traits, replay", [(("random", "replayable"), True), (("random",), False)])
def test_remat_replays_only_replayable_random_ops(scratch_op, traits, replay):
    name = scratch_op(f"test_op_facts.draw{len(traits)}", infer=lambda types: TensorType((4,), F32),
                      traits=traits)
    g = Graph("r")
    seed = g.add_input("seed", TensorType((), DType.int64))
    g.set_outputs([g.op(name, seed)])
    node = g.outputs[0].producer
    assert is_recomputable(node, random=True) is replay
    assert not is_recomputable(node)


@pytest.mark.parametrize("traits, sinks", [(("view", "whole_view"), True), (("view",), False)])
def test_sink_views_moves_whole_views(scratch_op, traits, sinks):
    name = scratch_op(f"test_op_facts.view{len(traits)}", infer=_same, traits=traits)
    g = Graph("v")
    x = g.add_input("x", TensorType((4,), F32))
    g.set_outputs([g.op("neg", g.op(name, x))])
    out = SinkViews().run(g).graph
    assert [n.op_name for n in out.nodes] == (["neg", name] if sinks else [name, "neg"])


def test_exp_of_log_keeps_rsqrt_of_negative_zero():
    """``exp(log(rsqrt(x)))`` is NaN at ``x = -0.0`` (``rsqrt`` gives ``-inf``), so simplify must
    not fold it to ``rsqrt(x)``; ``exp(log(sqrt(x)))`` folds (``sqrt(-0.0)`` is ``-0.0``)."""
    from kiln.passes import PassManager

    for name, folds in (("rsqrt", False), ("sqrt", True)):
        graph = ir.parse(f"""
graph @g(%x: f32[3]) {{
  %0: f32[3] = {name}(%x)
  %1: f32[3] = log(%0)
  %2: f32[3] = exp(%1)
  return %2
}}""")
        out = PassManager("simplify").run(graph).graph
        assert ("exp" not in {n.op_name for n in out.nodes}) == folds, (name, str(out))
    x = np.array([-0.0, 1.0, 4.0], dtype=np.float32)
    with np.errstate(all="ignore"):
        assert np.isnan(np.exp(np.log(1.0 / np.sqrt(x))))[0] and np.isneginf(1.0 / np.sqrt(x))[0]
