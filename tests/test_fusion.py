"""Tests of the ``fuse`` pass, the ``fused`` op and ``kernel_count``.

Each text case parses ``before``, runs ``fuse`` and compares with ``expected``; every case is
also checked for verification, text round trip, idempotence and numeric equivalence.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln.ir as ir
from kiln.backends.reference import run_graph
from kiln.ir import DType, Graph, OpTypeError, TensorType
from kiln.passes import get_pass, parse_pipeline
from kiln.passes.composites import Composites
from kiln.passes.fusion import Fuse, kernel_count, partition

F32 = DType.float32


def random_inputs(graph: Graph, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)

    def make(v: ir.Value) -> np.ndarray:
        shape = tuple(v.shape)
        if v.dtype.is_floating and v.origin == "param":  # positive, e.g. for variances
            return rng.uniform(0.5, 1.5, shape).astype(v.dtype.numpy)
        if v.dtype.is_floating:
            return rng.standard_normal(shape).astype(v.dtype.numpy)
        if v.dtype == DType.bool:
            return rng.random(shape) < 0.5
        return rng.integers(0, 4, shape).astype(v.dtype.numpy)

    return [make(v) for v in graph.inputs], [make(v) for v in graph.params]


def assert_same_outputs(before: Graph, after: Graph, rtol: float = 1e-5) -> None:
    inputs, params = random_inputs(before)
    for want, got in zip(run_graph(before, inputs, params), run_graph(after, inputs, params)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-6)


def check_fuse(before: str, expected: str, **options) -> Graph:
    graph = ir.parse(before)
    result = Fuse(**options).run(graph)
    assert str(result.graph) == str(ir.parse(expected))
    assert result.changed == (str(graph) != str(result.graph))
    assert str(graph) == str(ir.parse(before)), "the input graph was mutated"
    ir.verify(result.graph)
    text = str(result.graph)
    assert str(ir.parse(text)) == text
    again = Fuse(**options).run(result.graph)
    assert not again.changed and again.graph is result.graph
    assert_same_outputs(graph, result.graph)
    return result.graph


def test_elementwise_chain_becomes_one_kernel_with_its_constant_copied_inside():
    check_fuse("""
graph @main(%x: f32[4, 8], %y: f32[4, 8]) {
  %c: f32[] = const 1.5
  %0: f32[4, 8] = exp(%x)
  %1: f32[4, 8] = add(%0, %c)
  %2: f32[4, 8] = relu(%1)
  %3: f32[4, 8] = mul(%2, %y)
  return %3
}""", """
graph @main(%x: f32[4, 8], %y: f32[4, 8]) {
  %3: f32[4, 8] = fused(%x, %y) {template=\"elementwise", body=graph @elementwise_0(%x: f32[4, 8], %y: f32[4, 8]) {
    %c: f32[] = const 1.5
    %0: f32[4, 8] = exp(%x)
    %1: f32[4, 8] = add(%0, %c)
    %2: f32[4, 8] = relu(%1)
    %3: f32[4, 8] = mul(%2, %y)
    return %3
  }}
  return %3
}""")


def test_matmul_takes_its_epilogue_but_not_its_prologue():
    check_fuse("""
graph @main(%x: f32[4, 8]) params(%w: f32[8, 16], %b: f32[16]) {
  %0: f32[4, 8] = neg(%x)
  %1: f32[4, 16] = matmul(%0, %w)
  %2: f32[4, 16] = add(%1, %b)
  %3: f32[4, 16] = relu(%2)
  return %3
}""", """
graph @main(%x: f32[4, 8]) params(%w: f32[8, 16], %b: f32[16]) {
  %0: f32[4, 8] = neg(%x)
  %3: f32[4, 16] = fused(%0, %w, %b) {template=\"matmul", body=graph @matmul_0(%0: f32[4, 8], %w: f32[8, 16], %b: f32[16]) {
    %1: f32[4, 16] = matmul(%0, %w)
    %2: f32[4, 16] = add(%1, %b)
    %3: f32[4, 16] = relu(%2)
    return %3
  }}
  return %3
}""")


def test_conv_with_batch_norm_relu_and_residual_add():
    check_fuse("""
graph @main(%x: f32[1, 2, 5, 5]) params(%w: f32[2, 2, 3, 3], %g: f32[2], %b: f32[2], %m: f32[2], %v: f32[2]) {
  %0: f32[1, 2, 5, 5] = conv(%x, %w) {stride=[1, 1], padding=[1, 1], dilation=[1, 1]}
  %1: f32[1, 2, 5, 5] = batch_norm(%0, %g, %b, %m, %v)
  %2: f32[1, 2, 5, 5] = add(%1, %x)
  %3: f32[1, 2, 5, 5] = relu(%2)
  return %3
}""", """
graph @main(%x: f32[1, 2, 5, 5]) params(%w: f32[2, 2, 3, 3], %g: f32[2], %b: f32[2], %m: f32[2], %v: f32[2]) {
  %3: f32[1, 2, 5, 5] = fused(%x, %w, %g, %b, %m, %v) {template=\"conv", body=graph @conv_0(%x: f32[1, 2, 5, 5], %w: f32[2, 2, 3, 3], %g: f32[2], %b: f32[2], %m: f32[2], %v: f32[2]) {
    %0: f32[1, 2, 5, 5] = conv(%x, %w) {stride=[1, 1], padding=[1, 1], dilation=[1, 1]}
    %1: f32[1, 2, 5, 5] = batch_norm(%0, %g, %b, %m, %v)
    %2: f32[1, 2, 5, 5] = add(%1, %x)
    %3: f32[1, 2, 5, 5] = relu(%2)
    return %3
  }}
  return %3
}""")


SOFTMAX = """
graph @main(%x: f32[4, 8]) {
  %c: f32[] = const 0.5
  %0: f32[4, 8] = mul(%x, %c)
  %1: f32[4, 1] = amax(%0) {dims=[-1], keepdim=true}
  %2: f32[4, 8] = sub(%0, %1)
  %3: f32[4, 8] = exp(%2)
  %4: f32[4, 1] = sum(%3) {dims=[-1], keepdim=true}
  %5: f32[4, 8] = div(%3, %4)
  %6: f32[4, 8] = add(%5, %x)
  return %6
}"""


def test_reductions_over_the_same_axes_share_a_kernel_with_prologue_and_epilogue():
    check_fuse(SOFTMAX, """
graph @main(%x: f32[4, 8]) {
  %6: f32[4, 8] = fused(%x) {template=\"reduction", body=graph @reduction_0(%x: f32[4, 8]) {
    %c: f32[] = const 0.5
    %0: f32[4, 8] = mul(%x, %c)
    %1: f32[4, 1] = amax(%0) {dims=[-1], keepdim=true}
    %2: f32[4, 8] = sub(%0, %1)
    %3: f32[4, 8] = exp(%2)
    %4: f32[4, 1] = sum(%3) {dims=[-1], keepdim=true}
    %5: f32[4, 8] = div(%3, %4)
    %6: f32[4, 8] = add(%5, %x)
    return %6
  }}
  return %6
}""")


def test_strategy_none_across_reductions_ends_a_kernel_at_each_reduction():
    check_fuse(SOFTMAX, """
graph @main(%x: f32[4, 8]) {
  %0: f32[4, 8], %1: f32[4, 1] = fused(%x) {template=\"reduction", body=graph @reduction_0(%x: f32[4, 8]) {
    %c: f32[] = const 0.5
    %0: f32[4, 8] = mul(%x, %c)
    %1: f32[4, 1] = amax(%0) {dims=[-1], keepdim=true}
    return %0, %1
  }}
  %3: f32[4, 8], %4: f32[4, 1] = fused(%0, %1) {template=\"reduction", body=graph @reduction_1(%0: f32[4, 8], %1: f32[4, 1]) {
    %2: f32[4, 8] = sub(%0, %1)
    %3: f32[4, 8] = exp(%2)
    %4: f32[4, 1] = sum(%3) {dims=[-1], keepdim=true}
    return %3, %4
  }}
  %6: f32[4, 8] = fused(%3, %4, %x) {template=\"elementwise", body=graph @elementwise_2(%3: f32[4, 8], %4: f32[4, 1], %x: f32[4, 8]) {
    %5: f32[4, 8] = div(%3, %4)
    %6: f32[4, 8] = add(%5, %x)
    return %6
  }}
  return %6
}""", strategy="none-across-reductions")


def test_strategy_elementwise_only_leaves_reductions_alone():
    # mul cannot join sub: the path mul -> amax -> sub leaves the group and re-enters it.
    check_fuse(SOFTMAX, """
graph @main(%x: f32[4, 8]) {
  %c: f32[] = const 0.5
  %0: f32[4, 8] = mul(%x, %c)
  %1: f32[4, 1] = amax(%0) {dims=[-1], keepdim=true}
  %3: f32[4, 8] = fused(%0, %1) {template=\"elementwise", body=graph @elementwise_0(%0: f32[4, 8], %1: f32[4, 1]) {
    %2: f32[4, 8] = sub(%0, %1)
    %3: f32[4, 8] = exp(%2)
    return %3
  }}
  %4: f32[4, 1] = sum(%3) {dims=[-1], keepdim=true}
  %6: f32[4, 8] = fused(%3, %4, %x) {template=\"elementwise", body=graph @elementwise_1(%3: f32[4, 8], %4: f32[4, 1], %x: f32[4, 8]) {
    %5: f32[4, 8] = div(%3, %4)
    %6: f32[4, 8] = add(%5, %x)
    return %6
  }}
  return %6
}""", strategy="elementwise-only")


def test_reductions_over_different_axes_stay_in_different_kernels():
    graph = ir.parse("""
graph @main(%x: f32[4, 8]) {
  %0: f32[4, 8] = exp(%x)
  %1: f32[4, 1] = sum(%0) {dims=[1], keepdim=true}
  %2: f32[1, 8] = sum(%0) {dims=[0], keepdim=true}
  %3: f32[4, 8] = add(%1, %2)
  return %3
}""")
    groups = partition(graph)
    sums = [[n for n in g if n.op_name == "sum"] for g in groups]
    assert all(len(s) <= 1 for s in sums)
    assert_same_outputs(graph, Fuse().run(graph).graph)


def test_fusing_across_an_outside_node_would_make_a_cycle_and_does_not_happen():
    # exp and add are both elementwise, but a kernel {exp, add} would need cumsum's result,
    # which needs the kernel's own result.
    cyclic = """
graph @main(%x: f32[8]) {
  %0: f32[8] = exp(%x)
  %1: f32[8] = cumsum(%0) {dim=0}
  %2: f32[8] = add(%0, %1)
  return %2
}"""
    check_fuse(cyclic, cyclic)
    check_fuse(cyclic, cyclic, strategy="elementwise-only")


def test_max_nodes_bounds_every_kernel():
    check_fuse("""
graph @main(%x: f32[8]) {
  %0: f32[8] = exp(%x)
  %1: f32[8] = neg(%0)
  %2: f32[8] = sin(%1)
  %3: f32[8] = cos(%2)
  %4: f32[8] = abs(%3)
  return %4
}""", """
graph @main(%x: f32[8]) {
  %1: f32[8] = fused(%x) {template=\"elementwise", body=graph @elementwise_0(%x: f32[8]) {
    %0: f32[8] = exp(%x)
    %1: f32[8] = neg(%0)
    return %1
  }}
  %3: f32[8] = fused(%1) {template=\"elementwise", body=graph @elementwise_1(%1: f32[8]) {
    %2: f32[8] = sin(%1)
    %3: f32[8] = cos(%2)
    return %3
  }}
  %4: f32[8] = abs(%3)
  return %4
}""", max_nodes=2)


def test_values_used_outside_become_extra_results():
    check_fuse("""
graph @main(%x: f32[8]) {
  %0: f32[8] = exp(%x)
  %1: f32[8] = neg(%0)
  %2: f32[8] = cumsum(%0) {dim=0}
  return %1, %2
}""", """
graph @main(%x: f32[8]) {
  %0: f32[8], %1: f32[8] = fused(%x) {template=\"elementwise", body=graph @elementwise_0(%x: f32[8]) {
    %0: f32[8] = exp(%x)
    %1: f32[8] = neg(%0)
    return %0, %1
  }}
  %2: f32[8] = cumsum(%0) {dim=0}
  return %1, %2
}""")


def test_views_join_between_members_but_border_views_stay_outside():
    check_fuse("""
graph @main(%x: f32[4, 8], %y: f32[8, 4]) {
  %0: f32[4, 8] = exp(%x)
  %1: f32[32] = reshape(%0) {shape=[32]}
  %2: f32[32] = neg(%1)
  %3: f32[4, 8] = permute(%y) {dims=[1, 0]}
  %4: f32[4, 8] = add(%0, %3)
  %5: f32[8, 4] = permute(%4) {dims=[1, 0]}
  return %2, %5
}""", """
graph @main(%x: f32[4, 8], %y: f32[8, 4]) {
  %3: f32[4, 8] = permute(%y) {dims=[1, 0]}
  %2: f32[32], %4: f32[4, 8] = fused(%x, %3) {template=\"elementwise", body=graph @elementwise_0(%x: f32[4, 8], %3: f32[4, 8]) {
    %0: f32[4, 8] = exp(%x)
    %1: f32[32] = reshape(%0) {shape=[32]}
    %2: f32[32] = neg(%1)
    %4: f32[4, 8] = add(%0, %3)
    return %2, %4
  }}
  %5: f32[8, 4] = permute(%4) {dims=[1, 0]}
  return %2, %5
}""")


def test_large_constants_are_operands_and_creation_ops_are_copied_inside():
    big = ", ".join(str(float(i)) for i in range(40))
    check_fuse(f"""
graph @main(%x: f32[40]) {{
  %big: f32[40] = const [{big}]
  %0: f32[40] = full() {{shape=[40], value=2.0, dtype=f32}}
  %1: f32[40] = mul(%x, %0)
  %2: f32[40] = add(%1, %big)
  return %2
}}""", f"""
graph @main(%x: f32[40]) {{
  %big: f32[40] = const [{big}]
  %2: f32[40] = fused(%x, %big) {{template=\"elementwise", body=graph @elementwise_0(%x: f32[40], %big: f32[40]) {{
    %0: f32[40] = full() {{shape=[40], value=2.0, dtype=f32}}
    %1: f32[40] = mul(%x, %0)
    %2: f32[40] = add(%1, %big)
    return %2
  }}}}
  return %2
}}""")


def test_fused_nodes_and_opaque_ops_are_never_regrouped():
    graph = ir.parse(SOFTMAX)
    once = Fuse().run(graph).graph
    assert kernel_count(once) == 1
    assert Fuse(strategy="elementwise-only").run(once).changed is False


def test_kernel_count_skips_views_and_creation_ops():
    graph = ir.parse("""
graph @main(%x: f32[4, 8]) {
  %0: f32[4, 8] = full() {shape=[4, 8], value=1.0, dtype=f32}
  %1: f32[4, 8] = add(%x, %0)
  %2: f32[8, 4] = permute(%1) {dims=[1, 0]}
  %3: f32[8, 4] = exp(%2)
  return %3
}""")
    assert kernel_count(graph) == 2
    fused = Fuse().run(graph).graph
    assert kernel_count(fused) == 1


def test_options_from_pipeline_text_and_bad_options():
    (fuse,) = parse_pipeline("fuse{max_nodes=4,strategy=elementwise-only}")
    assert fuse == Fuse(max_nodes=4, strategy="elementwise-only")
    assert get_pass("fuse") == Fuse()
    with pytest.raises(ValueError, match=r"unknown strategy 'fastest'; choose one of greedy"):
        Fuse(strategy="fastest")
    with pytest.raises(ValueError, match=r"max_nodes must be at least 1"):
        Fuse(max_nodes=0)


def random_graph(seed: int) -> Graph:
    """A random DAG of elementwise, reduction, matmul, opaque (cumsum) and view nodes."""
    rng = np.random.default_rng(seed)
    g = Graph(f"random{seed}")
    full = TensorType((4, 6), F32)
    pool = [g.add_input("x", full), g.add_input("y", full)]
    rows = [g.add_input("r", TensorType((4, 1), F32))]
    w = g.add_param("w", TensorType((6, 6), F32))
    for _ in range(int(rng.integers(6, 18))):
        a = pool[int(rng.integers(len(pool)))]
        choice = int(rng.integers(8))
        if choice == 0:
            pool.append(g.op(["tanh", "neg", "sin", "relu"][int(rng.integers(4))], a))
        elif choice == 1:
            b = (pool + rows)[int(rng.integers(len(pool) + len(rows)))]
            pool.append(g.op(["add", "mul", "sub"][int(rng.integers(3))], a, b))
        elif choice == 2:
            rows.append(g.op(["sum", "amax"][int(rng.integers(2))], a, dims=(1,), keepdim=True))
        elif choice == 3:
            pool.append(g.op("matmul", a, w))
        elif choice == 4:
            pool.append(g.op("cumsum", a, dim=1))
        elif choice == 5:
            flat = g.op("neg", g.op("reshape", a, shape=(24,)))
            pool.append(g.op("reshape", flat, shape=(4, 6)))
        else:
            b = pool[int(rng.integers(len(pool)))]
            pool.append(g.op("add", a, g.op("mul", b, rows[int(rng.integers(len(rows)))])))
    g.set_outputs(pool[-1:] + pool[2:-1:3] + rows[1:2])
    return g


@pytest.mark.parametrize("seed", range(24))
def test_random_graphs_fuse_into_acyclic_bounded_kernels_with_the_same_outputs(seed):
    graph = random_graph(seed)
    strategy = ("greedy", "elementwise-only", "none-across-reductions")[seed % 3]
    max_nodes = (2, 3, 32)[seed // 3 % 3]
    fuse = Fuse(max_nodes=max_nodes, strategy=strategy)
    result = fuse.run(graph)
    ir.verify(result.graph)  # includes: every operand is defined before its use
    for node in result.graph.nodes:
        if node.op_name == "fused":
            body = node.attrs["body"]
            assert 2 <= len([n for n in body.nodes if n.op.name != "full"]) <= max_nodes
            assert not any(n.op_name == "cumsum" for n in body.nodes)
    assert not fuse.run(result.graph).changed
    assert_same_outputs(graph, result.graph)
    text = str(result.graph)
    assert str(ir.parse(text)) == text


# ---------------------------------------------------------------------- the fused op
def _body() -> Graph:
    body = Graph("body")
    a = body.add_input("a", TensorType((2, 3), F32))
    b = body.add_input("b", TensorType((3,), F32))
    s = body.op("add", a, b)
    body.set_outputs([body.op("relu", s), s])
    return body


def test_fused_op_infers_the_body_outputs_and_runs_the_body():
    g = Graph()
    x = g.add_input("x", TensorType((2, 3), F32))
    y = g.add_input("y", TensorType((3,), F32))
    node = g.add_node("fused", [x, y], {"template": "elementwise", "body": _body()})
    assert [v.type for v in node.outputs] == [TensorType((2, 3), F32)] * 2
    g.set_outputs(node.outputs)
    xs = [np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]], np.float32), np.ones(3, np.float32)]
    relu, total = run_graph(g, xs, [])
    np.testing.assert_array_equal(total, xs[0] + 1)
    np.testing.assert_array_equal(relu, np.maximum(xs[0] + 1, 0))
    (oracle, _) = run_graph(g, xs, [], float64=True)
    assert oracle.dtype == np.float64
    text = str(g)
    assert str(ir.parse(text)) == text


@pytest.mark.parametrize("operands, attrs, message", [
    ([(2, 3), (4,)], {"template": "elementwise"}, r"operand 1 is f32\[4\] but body input %b is f32\[3\]"),
    ([(2, 3)], {"template": "elementwise"}, r"body @body takes 2 inputs, got 1 operands"),
    ([(2, 3), (3,)], {"template": "vector"}, r"template 'vector' is not one of elementwise, reduction"),
])
def test_fused_op_rejects_mismatched_operands(operands, attrs, message):
    g = Graph()
    values = [g.add_input(f"i{i}", TensorType(s, F32)) for i, s in enumerate(operands)]
    with pytest.raises(OpTypeError, match=r"^fused\(.*\): " + message):
        g.add_node("fused", values, {**attrs, "body": _body()})


def test_fused_op_rejects_a_body_with_params():
    body = Graph("withparams")
    w = body.add_param("w", TensorType((3,), F32))
    body.set_outputs([body.op("neg", w)])
    with pytest.raises(OpTypeError, match=r"body @withparams has params \(%w\); pass them as operands"):
        Graph().add_node("fused", [], {"template": "opaque", "body": body})


# -------------------------------------------------------------------------- models
@pytest.fixture(scope="module", params=["mlp", "resnet18", "gpt2", "bert"])
def model_case(request):
    from kiln.frontends.torch.capture import capture
    from tests.models import MODELS

    build, inputs_fn = MODELS[request.param]
    model = build()
    args, kwargs = inputs_fn()
    captured = capture(model, args, kwargs)
    with torch.no_grad():
        eager = [t.numpy() for t in torch.utils._pytree.tree_leaves(model(*args, **kwargs))
                 if isinstance(t, torch.Tensor)]
    inputs = [a.numpy() for a in args] + [v.numpy() for v in kwargs.values()]
    params = [captured.params[p.name].detach().numpy() for p in captured.graph.params]
    return request.param, captured.graph, inputs, params, eager


def test_fusion_on_models_matches_eager_and_reports_kernel_counts(model_case):
    from kiln.passes import DEFAULT_PIPELINE, PassManager

    name, graph, inputs, params, eager = model_case
    cleanup = [p for p in DEFAULT_PIPELINE.split(",") if p not in ("composites", "fuse")]
    optimized = PassManager(cleanup).run(graph).graph
    composed = Composites().run(optimized).graph
    fused = Fuse().run(composed).graph
    counts = [kernel_count(g) for g in (graph, optimized, composed, fused)]
    print(f"\n{name}: kernels captured {counts[0]}, cleaned up {counts[1]}, "
          f"composites {counts[2]}, fused {counts[3]}")
    assert counts[3] < counts[2] <= counts[1]
    ir.verify(fused)
    assert not Fuse().run(fused).changed
    outputs = run_graph(fused, inputs, params)
    assert len(outputs) == len(eager)
    for got, want in zip(outputs, eager):
        scale = max(float(np.abs(want).max()), 1e-6)
        assert float(np.abs(got - want).max()) / scale <= 1e-4
    text = str(fused)
    assert str(ir.parse(text)) == text


def test_the_docs_section_examples_run():
    """The python blocks of "Composite recognition and fusion" in docs/passes.md."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "passes.md").read_text()
    section = text[text.index("## Composite recognition and fusion"):]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    assert blocks
    namespace: dict = {"ir": ir, "np": np}
    for code in blocks:
        exec(compile(code, "docs/passes.md", "exec"), namespace)


ONE_HOT = """
graph @ce(%t: i64[64, 1], %w: f32[64, 1], %iota: i64[1, 1000], %x: f32[64, 1000]) {
  %z: f32[] = const 0.0
  %0: f32[] = sum(%w)
  %1: f32[64, 1] = div(%w, %0)
  %2: bool[64, 1000] = eq(%t, %iota)
  %3: f32[64, 1000] = where(%2, %1, %z)
  %4: f32[64, 1000] = CONSUMER
  %5: f32[64, 1000] = sub(%4, %3)
  return %5
}"""


def _group_with(groups: list, name: str) -> set[str]:
    return next({o.name for n in g for o in n.outputs} for g in groups if any(o.name == name for n in g for o in n.outputs))


def test_an_expansion_goes_to_its_consumer_not_its_producer():
    """A one-hot built from small operands (a cross-entropy gradient) is recomputed inside
    the kernel that consumes it, not stored by the kernel of the small reduction it reads."""
    graph = ir.parse(ONE_HOT.replace("CONSUMER", "softmax(%x) {dim=1}"))
    groups = partition(graph)
    assert {"2", "3", "4", "5"} <= _group_with(groups, "4")
    assert "3" not in _group_with(groups, "0")
    assert_same_outputs(graph, Fuse().run(graph).graph)


def test_an_expansion_no_consumer_takes_joins_its_producers():
    graph = ir.parse(ONE_HOT.replace("CONSUMER", "matmul(%x, %m)").replace(
        "%x: f32[64, 1000])", "%x: f32[64, 1000], %m: f32[1000, 1000])").replace(
        "%5: f32[64, 1000] = sub(%4, %3)\n  return %5", "%5: f32[64, 1000] = matmul(%3, %m)\n  return %4, %5"))
    groups = partition(graph)
    assert {"0", "1", "2", "3"} <= _group_with(groups, "0")
    assert_same_outputs(graph, Fuse().run(graph).graph)
