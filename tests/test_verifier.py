"""The verifier reports the first broken invariant: node, operand/result position, got, expected.

The builders refuse ill-formed graphs, so each broken graph here is a valid graph whose
internals were then edited by hand, the way a buggy pass would.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kiln.ir import (
    Attr,
    DType,
    Graph,
    OpDef,
    TensorType,
    Value,
    VerificationError,
    defop,
    get_op,
    parse,
    verify,
)
from kiln.ir import registry

F32 = DType.float32
BODY = "test_verifier.body"


@pytest.fixture(scope="module", autouse=True)
def body_op():
    """A test-only op holding a subgraph; removed afterwards so other tests never see it."""
    defop(BODY, infer=lambda types, *, body: tuple(v.type for v in body.outputs),
          num_inputs=(0, None), attrs={"body": Attr("graph")})(lambda *xs, body: xs)
    yield
    registry._REGISTRY.pop(BODY, None)


def small_graph() -> Graph:
    """%x, %y -> %0 = add, %1 = mul(%0, %c), %2 = gelu(%1); returns %2."""
    return parse("""graph @small(%x: f32[2, 3], %y: f32[2, 3]) {
      %c: f32[] = const 0.5
      %0: f32[2, 3] = add(%x, %y)
      %1: f32[2, 3] = mul(%0, %c)
      %2: f32[2, 3] = gelu(%1) {approximate="tanh"}
      return %2
    }""")


def test_valid_graphs_pass():
    g = small_graph()
    verify(g)
    verify(g.clone())
    verify(Graph("empty"))


def test_type_mismatch_names_node_result_got_and_expected():
    g = small_graph()
    g.nodes[1].outputs[0].type = TensorType((2, 3), DType.float16)
    with pytest.raises(VerificationError, match=(
        r"graph @small: node #1 \(%1 = mul\): type mismatch: result 0 \(%1\) has type f16\[2, 3\], "
        r"expected f32\[2, 3\] \(inferred from operands f32\[2, 3\], f32\[\]\)")):
        verify(g)


def test_type_mismatch_after_an_operand_is_swapped():
    g = small_graph()
    wide = g.add_input("wide", TensorType((4, 2, 3), F32))
    add = g.nodes[0]
    add.inputs = (add.inputs[0], wide)
    with pytest.raises(VerificationError, match=(
        r"node #0 \(%0 = add\): type mismatch: result 0 \(%0\) has type f32\[2, 3\], "
        r"expected f32\[4, 2, 3\]")):
        verify(g)


def test_operands_inference_rejects():
    g = small_graph()
    bad = g.add_input("bad", TensorType((5,), F32))
    g.nodes[0].inputs = (g.inputs[0], bad)
    with pytest.raises(VerificationError, match=r"node #0 \(%0 = add\): inference rejects the node: "
                                                r"add\(f32\[2, 3\], f32\[5\]\): .*do not broadcast"):
        verify(g)


def test_use_before_definition():
    g = small_graph()
    g.nodes[0], g.nodes[1] = g.nodes[1], g.nodes[0]
    with pytest.raises(VerificationError, match=(
        r"node #0 \(%1 = mul\): use before definition: operand 0 \(%0\) is defined by node #1, "
        r"after its use")):
        verify(g)


def test_operand_from_another_graph():
    g = small_graph()
    stranger = small_graph().inputs[1]
    g.nodes[0].inputs = (g.inputs[0], stranger)
    with pytest.raises(VerificationError, match=r"node #0 \(%0 = add\): operand 1 \(%y\) is not defined "
                                                r"in this graph"):
        verify(g)


def test_unknown_op():
    g = small_graph()
    g.nodes[2].op = OpDef(name="mystery", infer=lambda types: types[0])
    with pytest.raises(VerificationError, match=r"node #2 \(%2 = mystery\): op 'mystery' is not registered"):
        verify(g)


def test_op_with_a_registered_name_but_another_definition():
    g = small_graph()
    g.nodes[0].op = dataclasses.replace(get_op("add"))
    with pytest.raises(VerificationError, match=r"node #0 \(%0 = add\): op 'add' is a different OpDef"):
        verify(g)


@pytest.mark.parametrize("edit, pattern", [
    (lambda a: a.update(approximate=3), r"bad attribute: gelu.*attribute 'approximate' expects str, got 3"),
    (lambda a: a.update(alpha=1.0),
     r"bad attribute: unknown attribute\(s\) \['alpha'\]; expected only \['approximate'\]"),
    (lambda a: a.clear(), r"bad attribute: 'approximate' is missing; expected a str"),
], ids=["wrong-kind", "unknown", "missing"])
def test_bad_attribute(edit, pattern):
    g = small_graph()
    edit(g.nodes[2].attrs)
    with pytest.raises(VerificationError, match=r"node #2 \(%2 = gelu\): " + pattern):
        verify(g)


def test_undefined_output():
    g = small_graph()
    g.outputs.append(Value("ghost", TensorType((1,), F32), "result"))
    with pytest.raises(VerificationError,
                       match=r"graph @small: output 1 \(%ghost\) is not defined in this graph"):
        verify(g)


def test_removed_node_leaves_undefined_output():
    g = small_graph()
    g.nodes.pop()
    with pytest.raises(VerificationError, match=r"output 0 \(%2\) is not defined"):
        verify(g)


def test_duplicate_value_names():
    g = small_graph()
    g.nodes[1].outputs[0].name = "x"
    with pytest.raises(VerificationError, match=r"value name %x is defined twice \(as an input and as "
                                                r"result 0 of mul\)"):
        verify(g)


def test_result_must_point_back_to_its_producer():
    g = small_graph()
    g.nodes[1].outputs[0].producer = g.nodes[0]
    with pytest.raises(VerificationError, match=r"node #1 \(%1 = mul\): result 0 \(%1\) records producer "
                                                r".*expected this node, index 0"):
        verify(g)


def test_constant_data_must_match_its_type():
    g = small_graph()
    g.constants[0].data = np.zeros((2,), np.float64)
    with pytest.raises(VerificationError,
                       match=r"constant %c: data is f64\[2\], expected f32\[\] as declared"):
        verify(g)


def test_value_listed_in_the_wrong_place():
    g = small_graph()
    g.params.append(g.inputs.pop())
    with pytest.raises(VerificationError,
                       match=r"%y is listed among the params but is recorded as kind 'input'"):
        verify(g)


def test_first_violation_is_reported():
    g = small_graph()
    g.nodes[2].attrs["approximate"] = 3  # later violation
    g.nodes[0].op = OpDef(name="mystery", infer=lambda types: types[0])  # earlier one
    with pytest.raises(VerificationError, match=r"node #0 \(%0 = mystery\)"):
        verify(g)


def _body() -> Graph:
    body = Graph("body")
    a = body.add_input("a", TensorType((2,), F32))
    body.set_outputs([body.op("neg", a)])
    return body


def test_nested_graph_attributes_are_verified():
    g = Graph("outer")
    x = g.add_input("x", TensorType((2,), F32))
    g.set_outputs([g.add_node(BODY, [x], {"body": _body()}).output])
    verify(g)
    g.nodes[0].attrs["body"].nodes[0].outputs[0].type = TensorType((3,), F32)
    with pytest.raises(VerificationError, match=(
        r"graph @outer: node #0 \(%0 = test_verifier.body\): attribute 'body' graph 0 @body: "
        r"node #0 \(%0 = neg\): type mismatch: result 0 \(%0\) has type f32\[3\], expected f32\[2\]")):
        verify(g)


def test_verify_does_not_change_the_graph():
    g = small_graph()
    before = str(g)
    verify(g)
    assert str(g) == before
