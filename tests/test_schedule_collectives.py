"""The collective IR ops without a process group: inference, the single-process simulation
(every rank holds this process's operand, this process is rank 0), gradient rules, text
form, and both backends.  Their torch.distributed path runs in tests/test_schedule_dist.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.backends import get_backend
from kiln.ir import DType, Graph, OpTypeError, TensorType, get_op, parse
from kiln.ir.ops.collectives import COLLECTIVES
from kiln.passes.autodiff import grad_graph


def _graph(op: str, shape=(4, 6), **attrs) -> Graph:
    g = Graph(op)
    x = g.add_input("x", TensorType(shape, DType.float32))
    g.set_outputs([g.op(op, x, **attrs)])
    return g


X = np.arange(24, dtype=np.float32).reshape(4, 6)


@pytest.mark.parametrize("op, attrs, shape, want", [
    ("all_reduce", {"world_size": 2}, (4, 6), X * 2),
    ("all_reduce", {"world_size": 3, "fwd": False}, (4, 6), X),
    ("all_gather", {"world_size": 2, "dim": 1}, (4, 12), np.concatenate([X, X], 1)),
    ("reduce_scatter", {"world_size": 2, "dim": 0}, (2, 6), X[:2] * 2),
    ("reduce_scatter", {"world_size": 3, "dim": 1, "mode": "slice"}, (4, 2), X[:, :2]),
    ("all_to_all", {"world_size": 2, "split_dim": 1, "concat_dim": 0}, (8, 3), np.concatenate([X[:, :3]] * 2, 0)),
])
def test_simulated_reference_and_cpu_backend(op, attrs, shape, want):
    g = _graph(op, **attrs)
    assert tuple(g.outputs[0].shape) == shape
    assert str(parse(str(g))) == str(g)
    for backend in ("reference", "cpu"):
        exe = get_backend(backend).build(g, {"cache": False}) if backend == "cpu" else get_backend(backend).build(g)
        (got,) = exe([torch.from_numpy(X)])
        np.testing.assert_array_equal(got.numpy(), want)


def test_gradient_rules_are_the_transposes():
    g = Graph("chain")
    x = g.add_input("x", TensorType((4, 6), DType.float32))
    a = g.op("all_reduce", x, world_size=2)
    b = g.op("all_gather", a, world_size=2, dim=1, grad="slice")
    c = g.op("all_to_all", b, world_size=2, split_dim=1, concat_dim=0)
    d = g.op("reduce_scatter", c, world_size=2, dim=0)
    e = g.op("all_reduce", d, world_size=2, bwd=False)
    g.set_outputs([e])
    joint = grad_graph(g, wrt=["x"], output_cotangents=True).graph
    backward = [(n.op_name, dict(n.attrs)) for n in joint.nodes[5:]]
    assert backward == [
        ("all_gather", {"world_size": 2, "dim": 0, "grad": "sum"}),          # reduce_scatter's
        ("all_to_all", {"world_size": 2, "split_dim": 0, "concat_dim": 1}),  # axes swapped
        ("reduce_scatter", {"world_size": 2, "dim": 1, "mode": "slice"}),    # all_gather{grad=slice}'s
        ("all_reduce", {"world_size": 2, "fwd": True, "bwd": True}),         # all_reduce's
    ]  # the last all_reduce (bwd=false) passes its cotangent on: no node
    assert all(get_op(op).has("random") for op in COLLECTIVES)  # impure: never folded, merged, removed


def test_simulated_gradient_matches_a_replicated_program():
    # With every rank holding the same x, all_reduce(x) = 2x and its transpose doubles too.
    g = _graph("all_reduce", world_size=2)
    joint = grad_graph(g, wrt=["x"], output_cotangents=True).graph
    ct = torch.ones(4, 6)
    y, dx = get_backend("reference").build(joint)([torch.from_numpy(X), ct])
    np.testing.assert_array_equal(dx.numpy(), 2 * np.ones((4, 6), np.float32))


def test_collectives_are_not_folded_or_merged():
    from kiln.passes import DEFAULT_PIPELINE, PassManager
    g = Graph("c")
    x = g.add_constant(X, DType.float32)
    inp = g.add_input("y", TensorType((4, 6), DType.float32))
    a = g.op("all_reduce", x, world_size=2)
    b = g.op("all_reduce", inp, world_size=2)
    c = g.op("all_reduce", inp, world_size=2)
    g.set_outputs([g.op("add", a, g.op("add", b, c))])
    out = PassManager(DEFAULT_PIPELINE).run(g).graph
    assert out.op_histogram()["all_reduce"] == 3


@pytest.mark.parametrize("op, attrs, match", [
    ("reduce_scatter", {"world_size": 4, "dim": 1}, "size 6, which 4 ranks cannot split evenly"),
    ("all_to_all", {"world_size": 4, "split_dim": 1, "concat_dim": 0}, "split axis 1 of shape"),
    ("all_reduce", {"world_size": 2, "fwd": False, "bwd": False}, "reduces nothing"),
    ("all_gather", {"world_size": 0, "dim": 0}, "world_size must be >= 1"),
    ("all_gather", {"world_size": 2, "dim": 0, "grad": "mean"}, "mode must be 'sum' or 'slice'"),
])
def test_bad_attributes_raise_with_the_shapes(op, attrs, match):
    with pytest.raises(OpTypeError, match=match):
        _graph(op, **attrs)
