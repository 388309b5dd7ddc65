"""Tests of the ``composites`` pass: IR-text before/after cases, cases that must not fire,
and graphs exported from PyTorch with decompositions that break the composites apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln.ir as ir
from kiln.backends.reference import run_graph
from kiln.ir import DType, Graph
from kiln.passes import get_pass, parse_pipeline
from kiln.passes.composites import PATTERN_GROUPS, Composites


def random_inputs(graph: Graph, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)

    def make(v: ir.Value) -> np.ndarray:
        shape = tuple(v.shape)
        if v.dtype.is_floating:
            return rng.standard_normal(shape).astype(v.dtype.numpy)
        if v.dtype == DType.bool:
            return rng.random(shape) < 0.7
        return rng.integers(0, 4, shape).astype(v.dtype.numpy)

    return [make(v) for v in graph.inputs], [make(v) for v in graph.params]


def assert_same_outputs(before: Graph, after: Graph, rtol: float = 1e-4) -> None:
    inputs, params = random_inputs(before)
    for want, got in zip(run_graph(before, inputs, params), run_graph(after, inputs, params)):
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = max(float(np.nanmax(np.abs(want))), 1e-6)
        np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale)


def check(before: str, expected: str, patterns: str = "all") -> Graph:
    graph = ir.parse(before)
    result = Composites(patterns=patterns).run(graph)
    assert str(result.graph) == str(ir.parse(expected))
    assert result.changed == (str(graph) != str(result.graph))
    assert str(graph) == str(ir.parse(before)), "the input graph was mutated"
    ir.verify(result.graph)
    again = Composites(patterns=patterns).run(result.graph)
    assert not again.changed
    assert_same_outputs(graph, result.graph)
    return result.graph


def check_unchanged(before: str) -> None:
    check(before, before)


# --------------------------------------------------------------------------- norms
def test_layer_norm_from_var_mean_with_weight_and_bias():
    check("""
graph @main(%x: f32[2, 5, 8]) params(%w: f32[8], %b: f32[8]) {
  %eps: f32[] = const 1e-05
  %0: f32[2, 5, 1] = var(%x) {dims=[2], keepdim=true, correction=0.0}
  %1: f32[2, 5, 1] = mean(%x) {dims=[2], keepdim=true}
  %2: f32[2, 5, 1] = add(%0, %eps)
  %3: f32[2, 5, 1] = rsqrt(%2)
  %4: f32[2, 5, 8] = sub(%x, %1)
  %5: f32[2, 5, 8] = mul(%4, %3)
  %6: f32[2, 5, 8] = mul(%5, %w)
  %7: f32[2, 5, 8] = add(%6, %b)
  return %7
}""", """
graph @main(%x: f32[2, 5, 8]) params(%w: f32[8], %b: f32[8]) {
  %10: f32[2, 5, 8] = layer_norm(%x, %w, %b) {normalized_rank=1}
  return %10
}""")


def test_a_weight_with_leading_unit_axes_is_reshaped_into_the_layer_norm():
    check("""
graph @main(%x: f32[2, 5, 8]) params(%w: f32[1, 1, 8], %b: f32[8]) {
  %eps: f32[] = const 1e-05
  %0: f32[2, 5, 1] = var(%x) {dims=[2], keepdim=true, correction=0.0}
  %1: f32[2, 5, 1] = mean(%x) {dims=[2], keepdim=true}
  %2: f32[2, 5, 1] = add(%0, %eps)
  %3: f32[2, 5, 1] = rsqrt(%2)
  %4: f32[2, 5, 8] = sub(%x, %1)
  %5: f32[2, 5, 8] = mul(%4, %3)
  %6: f32[2, 5, 8] = mul(%5, %w)
  %7: f32[2, 5, 8] = add(%b, %6)
  return %7
}""", """
graph @main(%x: f32[2, 5, 8]) params(%w: f32[1, 1, 8], %b: f32[8]) {
  %9: f32[8] = reshape(%w) {shape=[8]}
  %11: f32[2, 5, 8] = layer_norm(%x, %9, %b) {normalized_rank=1}
  return %11
}""")


def test_layer_norm_from_mean_of_squares_over_two_axes_with_sqrt_and_small_eps():
    check("""
graph @main(%x: f32[2, 3, 4]) params(%w: f32[3, 4]) {
  %eps: f32[] = const 1e-12
  %two: f32[] = const 2.0
  %0: f32[2, 1, 1] = mean(%x) {dims=[-2, -1], keepdim=true}
  %1: f32[2, 3, 4] = sub(%x, %0)
  %2: f32[2, 3, 4] = pow(%1, %two)
  %3: f32[2, 1, 1] = mean(%2) {dims=[1, 2], keepdim=true}
  %4: f32[2, 1, 1] = add(%eps, %3)
  %5: f32[2, 1, 1] = sqrt(%4)
  %6: f32[2, 3, 4] = div(%1, %5)
  %7: f32[2, 3, 4] = mul(%w, %6)
  return %7
}""", """
graph @main(%x: f32[2, 3, 4]) params(%w: f32[3, 4]) {
  %9: f32[2, 3, 4] = layer_norm(%x, %w) {normalized_rank=2, eps=1e-12}
  return %9
}""")


def test_rms_norm_with_weight():
    check("""
graph @main(%x: f32[2, 5, 8]) params(%w: f32[8]) {
  %two: f32[] = const 2.0
  %eps: f32[] = const 1e-06
  %0: f32[2, 5, 8] = pow(%x, %two)
  %1: f32[2, 5, 1] = mean(%0) {dims=[-1], keepdim=true}
  %2: f32[2, 5, 1] = add(%1, %eps)
  %3: f32[2, 5, 1] = rsqrt(%2)
  %4: f32[2, 5, 8] = mul(%x, %3)
  %5: f32[2, 5, 8] = mul(%w, %4)
  return %5
}""", """
graph @main(%x: f32[2, 5, 8]) params(%w: f32[8]) {
  %7: f32[2, 5, 8] = rms_norm(%x, %w) {normalized_rank=1}
  return %7
}""")


def test_layer_norm_is_found_even_when_only_the_layer_norm_group_is_enabled():
    check("""
graph @main(%x: f32[4, 8]) {
  %eps: f32[] = const 1e-05
  %0: f32[4, 1] = mean(%x) {dims=[1], keepdim=true}
  %1: f32[4, 8] = sub(%x, %0)
  %2: f32[4, 8] = mul(%1, %1)
  %3: f32[4, 1] = mean(%2) {dims=[1], keepdim=true}
  %4: f32[4, 1] = add(%3, %eps)
  %5: f32[4, 1] = rsqrt(%4)
  %6: f32[4, 8] = mul(%1, %5)
  return %6
}""", """
graph @main(%x: f32[4, 8]) {
  %7: f32[4, 8] = layer_norm(%x) {normalized_rank=1}
  return %7
}""", patterns="layer_norm")


@pytest.mark.parametrize("graph", [
    # normalizes axis 0, which layer_norm cannot express
    """graph @main(%x: f32[4, 4]) {
  %eps: f32[] = const 1e-05
  %0: f32[1, 4] = mean(%x) {dims=[0], keepdim=true}
  %1: f32[4, 4] = sub(%x, %0)
  %2: f32[4, 4] = mul(%1, %1)
  %3: f32[1, 4] = mean(%2) {dims=[0], keepdim=true}
  %4: f32[1, 4] = add(%3, %eps)
  %5: f32[1, 4] = rsqrt(%4)
  %6: f32[4, 4] = mul(%1, %5)
  return %6
}""",
    # keepdim=false: the mean broadcasts along the wrong axis
    """graph @main(%x: f32[4, 4]) {
  %eps: f32[] = const 1e-05
  %0: f32[4] = mean(%x) {dims=[1]}
  %1: f32[4, 4] = sub(%x, %0)
  %2: f32[4, 4] = mul(%1, %1)
  %3: f32[4, 1] = mean(%2) {dims=[1], keepdim=true}
  %4: f32[4, 1] = add(%3, %eps)
  %5: f32[4, 1] = rsqrt(%4)
  %6: f32[4, 4] = mul(%1, %5)
  return %6
}""",
    # eps is not a scalar
    """graph @main(%x: f32[2, 4]) {
  %eps: f32[2, 1] = const [1e-05, 0.1]
  %0: f32[2, 1] = mean(%x) {dims=[1], keepdim=true}
  %1: f32[2, 4] = sub(%x, %0)
  %2: f32[2, 4] = mul(%1, %1)
  %3: f32[2, 1] = mean(%2) {dims=[1], keepdim=true}
  %4: f32[2, 1] = add(%3, %eps)
  %5: f32[2, 1] = rsqrt(%4)
  %6: f32[2, 4] = mul(%1, %5)
  return %6
}""",
    # the variance and the mean reduce different axes
    """graph @main(%x: f32[2, 4, 4]) {
  %eps: f32[] = const 1e-05
  %0: f32[2, 4, 1] = mean(%x) {dims=[2], keepdim=true}
  %1: f32[2, 4, 4] = sub(%x, %0)
  %2: f32[2, 4, 4] = mul(%1, %1)
  %3: f32[2, 1, 1] = mean(%2) {dims=[1, 2], keepdim=true}
  %4: f32[2, 1, 1] = add(%3, %eps)
  %5: f32[2, 1, 1] = rsqrt(%4)
  %6: f32[2, 4, 4] = mul(%1, %5)
  return %6
}""",
    # unbiased variance is not layer norm's variance
    """graph @main(%x: f32[2, 8]) {
  %eps: f32[] = const 1e-05
  %0: f32[2, 1] = var(%x) {dims=[1], keepdim=true}
  %1: f32[2, 1] = mean(%x) {dims=[1], keepdim=true}
  %2: f32[2, 1] = add(%0, %eps)
  %3: f32[2, 1] = rsqrt(%2)
  %4: f32[2, 8] = sub(%x, %1)
  %5: f32[2, 8] = mul(%4, %3)
  return %5
}""",
])
def test_norms_that_are_not_layer_norm_are_left_alone(graph):
    # rms_norm may still apply to the centered value, which is correct; test layer_norm alone
    check(graph, graph, patterns="layer_norm")


def test_a_weight_that_does_not_have_the_normalized_shape_is_not_absorbed():
    check("""
graph @main(%x: f32[4, 8]) params(%w: f32[4, 1]) {
  %two: f32[] = const 2.0
  %eps: f32[] = const 1e-06
  %0: f32[4, 8] = pow(%x, %two)
  %1: f32[4, 1] = mean(%0) {dims=[1], keepdim=true}
  %2: f32[4, 1] = add(%1, %eps)
  %3: f32[4, 1] = rsqrt(%2)
  %4: f32[4, 8] = mul(%x, %3)
  %5: f32[4, 8] = mul(%4, %w)
  return %5
}""", """
graph @main(%x: f32[4, 8]) params(%w: f32[4, 1]) {
  %6: f32[4, 8] = rms_norm(%x) {normalized_rank=1}
  %5: f32[4, 8] = mul(%6, %w)
  return %5
}""")


# ------------------------------------------------------------------------- softmax
SOFTMAX = """
graph @main(%x: f32[3, 5]) {
  %0: f32[3, 1] = amax(%x) {dims=[-1], keepdim=true}
  %1: f32[3, 5] = sub(%x, %0)
  %2: f32[3, 5] = exp(%1)
  %3: f32[3, 1] = sum(%2) {dims=[-1], keepdim=true}
  %4: f32[3, 5] = div(%2, %3)
  %5: f32[3, 1] = log(%3)
  %6: f32[3, 5] = sub(%1, %5)
  return %4, %6
}"""


def test_softmax_and_log_softmax_sharing_their_decomposition():
    check(SOFTMAX, """
graph @main(%x: f32[3, 5]) {
  %7: f32[3, 5] = softmax(%x) {dim=1}
  %8: f32[3, 5] = log_softmax(%x) {dim=1}
  return %7, %8
}""")


def test_pattern_groups_can_be_selected():
    check(SOFTMAX, """
graph @main(%x: f32[3, 5]) {
  %0: f32[3, 1] = amax(%x) {dims=[-1], keepdim=true}
  %1: f32[3, 5] = sub(%x, %0)
  %2: f32[3, 5] = exp(%1)
  %3: f32[3, 1] = sum(%2) {dims=[-1], keepdim=true}
  %7: f32[3, 5] = softmax(%x) {dim=1}
  %5: f32[3, 1] = log(%3)
  %6: f32[3, 5] = sub(%1, %5)
  return %7, %6
}""", patterns="softmax, gelu")


def test_softmax_whose_max_and_sum_reduce_different_axes_is_not_a_softmax_of_x():
    # it is still exp(d) / sum(exp(d)), the (unshifted) softmax of d = x - amax(x, axis 0)
    check("""
graph @main(%x: f32[4, 4]) {
  %0: f32[1, 4] = amax(%x) {dims=[0], keepdim=true}
  %1: f32[4, 4] = sub(%x, %0)
  %2: f32[4, 4] = exp(%1)
  %3: f32[4, 1] = sum(%2) {dims=[1], keepdim=true}
  %4: f32[4, 4] = div(%2, %3)
  return %4
}""", """
graph @main(%x: f32[4, 4]) {
  %0: f32[1, 4] = amax(%x) {dims=[0], keepdim=true}
  %1: f32[4, 4] = sub(%x, %0)
  %5: f32[4, 4] = softmax(%1) {dim=1}
  return %5
}""")


# --------------------------------------------------------------------- activations
def test_gelu_erf_form_with_division_by_sqrt2():
    check("""
graph @main(%x: f32[4, 8]) {
  %half: f32[] = const 0.5
  %sqrt2: f32[] = const 1.4142135
  %one: f32[] = const 1.0
  %0: f32[4, 8] = mul(%x, %half)
  %1: f32[4, 8] = div(%x, %sqrt2)
  %2: f32[4, 8] = erf(%1)
  %3: f32[4, 8] = add(%one, %2)
  %4: f32[4, 8] = mul(%0, %3)
  return %4
}""", """
graph @main(%x: f32[4, 8]) {
  %5: f32[4, 8] = gelu(%x)
  return %5
}""")


def test_gelu_tanh_form_as_written_in_hugging_face_new_gelu():
    check("""
graph @main(%x: f32[4, 8]) {
  %half: f32[] = const 0.5
  %three: f32[] = const 3.0
  %cubic: f32[] = const 0.044715
  %k: f32[] = const 0.7978846
  %one: f32[] = const 1.0
  %0: f32[4, 8] = mul(%x, %half)
  %1: f32[4, 8] = pow(%x, %three)
  %2: f32[4, 8] = mul(%1, %cubic)
  %3: f32[4, 8] = add(%x, %2)
  %4: f32[4, 8] = mul(%3, %k)
  %5: f32[4, 8] = tanh(%4)
  %6: f32[4, 8] = add(%5, %one)
  %7: f32[4, 8] = mul(%0, %6)
  return %7
}""", """
graph @main(%x: f32[4, 8]) {
  %8: f32[4, 8] = gelu(%x) {approximate="tanh"}
  return %8
}""")


@pytest.mark.parametrize("dtype, rtol", [("f64", 1e-12), ("f16", 2e-3), ("bf16", 2e-2)])
def test_gelu_constants_are_compared_at_their_own_precision(dtype, rtol):
    graph = ir.parse(f"""
graph @main(%x: {dtype}[4, 8]) {{
  %half: {dtype}[] = const 0.5
  %sqrt2: {dtype}[] = const 1.4142135623730951
  %one: {dtype}[] = const 1.0
  %0: {dtype}[4, 8] = mul(%x, %half)
  %1: {dtype}[4, 8] = div(%x, %sqrt2)
  %2: {dtype}[4, 8] = erf(%1)
  %3: {dtype}[4, 8] = add(%one, %2)
  %4: {dtype}[4, 8] = mul(%0, %3)
  return %4
}}""")
    result = Composites().run(graph).graph
    assert result.op_histogram() == {"gelu": 1}
    assert_same_outputs(graph, result, rtol=rtol)


def test_gelu_with_the_half_applied_last():
    check("""
graph @main(%x: f32[4, 8]) {
  %half: f32[] = const 0.5
  %r: f32[] = const 0.70710677
  %one: f32[] = const 1.0
  %1: f32[4, 8] = mul(%r, %x)
  %2: f32[4, 8] = erf(%1)
  %3: f32[4, 8] = add(%2, %one)
  %4: f32[4, 8] = mul(%x, %3)
  %5: f32[4, 8] = mul(%4, %half)
  return %5
}""", """
graph @main(%x: f32[4, 8]) {
  %0: f32[4, 8] = gelu(%x)
  return %0
}""")


def test_gelu_like_expression_with_other_constants_is_left_alone():
    check_unchanged("""
graph @main(%x: f32[4, 8]) {
  %half: f32[] = const 0.5
  %r: f32[] = const 0.75
  %one: f32[] = const 1.0
  %0: f32[4, 8] = mul(%x, %half)
  %1: f32[4, 8] = mul(%x, %r)
  %2: f32[4, 8] = erf(%1)
  %3: f32[4, 8] = add(%2, %one)
  %4: f32[4, 8] = mul(%0, %3)
  return %4
}""")


def test_silu_forms():
    check("""
graph @main(%x: f32[4, 8]) {
  %one: f32[] = const 1.0
  %0: f32[4, 8] = sigmoid(%x)
  %1: f32[4, 8] = mul(%0, %x)
  %2: f32[4, 8] = neg(%x)
  %3: f32[4, 8] = exp(%2)
  %4: f32[4, 8] = add(%3, %one)
  %5: f32[4, 8] = div(%x, %4)
  return %1, %5
}""", """
graph @main(%x: f32[4, 8]) {
  %6: f32[4, 8] = silu(%x)
  %7: f32[4, 8] = silu(%x)
  return %6, %7
}""")


def test_silu_gated_mlp():
    check("""
graph @main(%x: f32[4, 8]) params(%w1: f32[8, 16], %w3: f32[8, 16], %w2: f32[16, 8]) {
  %0: f32[4, 16] = matmul(%x, %w1)
  %1: f32[4, 16] = sigmoid(%0)
  %2: f32[4, 16] = mul(%0, %1)
  %3: f32[4, 16] = matmul(%x, %w3)
  %4: f32[4, 16] = mul(%2, %3)
  %5: f32[4, 8] = matmul(%4, %w2)
  return %5
}""", """
graph @main(%x: f32[4, 8]) params(%w1: f32[8, 16], %w3: f32[8, 16], %w2: f32[16, 8]) {
  %0: f32[4, 16] = matmul(%x, %w1)
  %3: f32[4, 16] = matmul(%x, %w3)
  %7: f32[4, 16] = silu_mul(%0, %3)
  %5: f32[4, 8] = matmul(%7, %w2)
  return %5
}""")


def test_silu_gate_that_broadcasts_is_left_as_silu_times_b():
    check("""
graph @main(%a: f32[4, 16], %b: f32[16]) {
  %0: f32[4, 16] = silu(%a)
  %1: f32[4, 16] = mul(%0, %b)
  return %1
}""", """
graph @main(%a: f32[4, 16], %b: f32[16]) {
  %0: f32[4, 16] = silu(%a)
  %1: f32[4, 16] = mul(%0, %b)
  return %1
}""")


# ----------------------------------------------------------------------- attention
def test_attention_with_scale_and_additive_mask():
    check("""
graph @main(%q: f32[1, 2, 4, 8], %k: f32[1, 2, 6, 8], %v: f32[1, 2, 6, 8], %m: f32[1, 1, 4, 6]) {
  %s: f32[] = const 0.25
  %0: f32[1, 2, 8, 6] = permute(%k) {dims=[0, 1, 3, 2]}
  %1: f32[1, 2, 4, 6] = matmul(%q, %0)
  %2: f32[1, 2, 4, 6] = mul(%1, %s)
  %3: f32[1, 2, 4, 6] = add(%2, %m)
  %4: f32[1, 2, 4, 6] = softmax(%3) {dim=-1}
  %5: f32[1, 2, 4, 8] = matmul(%4, %v)
  return %5
}""", """
graph @main(%q: f32[1, 2, 4, 8], %k: f32[1, 2, 6, 8], %v: f32[1, 2, 6, 8], %m: f32[1, 1, 4, 6]) {
  %6: f32[1, 2, 4, 8] = scaled_dot_product_attention(%q, %k, %v, %m) {scale=0.25}
  return %6
}""")


def test_attention_with_default_scale_bool_mask_and_a_folded_transpose():
    # k^T arrives as one permute from [b, s, h, e]; the default scale 1/sqrt(8) is implied.
    check("""
graph @main(%q: f32[1, 2, 4, 8], %kr: f32[1, 6, 2, 8], %v: f32[1, 2, 6, 8], %m: bool[4, 6]) {
  %d: f32[] = const 2.828427
  %ninf: f32[] = const -inf
  %0: f32[1, 2, 8, 6] = permute(%kr) {dims=[0, 2, 3, 1]}
  %1: f32[1, 2, 4, 6] = matmul(%q, %0)
  %2: f32[1, 2, 4, 6] = div(%1, %d)
  %3: f32[1, 2, 4, 6] = where(%m, %2, %ninf)
  %4: f32[1, 2, 4, 6] = softmax(%3) {dim=3}
  %5: f32[1, 2, 4, 8] = matmul(%4, %v)
  return %5
}""", """
graph @main(%q: f32[1, 2, 4, 8], %kr: f32[1, 6, 2, 8], %v: f32[1, 2, 6, 8], %m: bool[4, 6]) {
  %6: f32[1, 2, 6, 8] = permute(%kr) {dims=[0, 2, 1, 3]}
  %7: f32[1, 2, 4, 8] = scaled_dot_product_attention(%q, %6, %v, %m)
  return %7
}""")


@pytest.mark.parametrize("graph", [
    # the mask is scaled too: not sdpa's math
    """graph @main(%q: f32[2, 4, 8], %k: f32[2, 6, 8], %v: f32[2, 6, 8], %m: f32[4, 6]) {
  %s: f32[] = const 0.25
  %0: f32[2, 8, 6] = permute(%k) {dims=[0, 2, 1]}
  %1: f32[2, 4, 6] = matmul(%q, %0)
  %2: f32[2, 4, 6] = add(%1, %m)
  %3: f32[2, 4, 6] = mul(%2, %s)
  %4: f32[2, 4, 6] = softmax(%3) {dim=-1}
  %5: f32[2, 4, 8] = matmul(%4, %v)
  return %5
}""",
    # softmax over the queries, not the keys
    """graph @main(%q: f32[2, 4, 8], %k: f32[2, 4, 8], %v: f32[2, 4, 8]) {
  %0: f32[2, 8, 4] = permute(%k) {dims=[0, 2, 1]}
  %1: f32[2, 4, 4] = matmul(%q, %0)
  %2: f32[2, 4, 4] = softmax(%1) {dim=1}
  %3: f32[2, 4, 8] = matmul(%2, %v)
  return %3
}""",
])
def test_attention_like_graphs_with_other_math_are_left_alone(graph):
    check_unchanged(graph)


def test_unknown_pattern_group_is_rejected_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown pattern group\(s\) rope; known: all, attention"):
        Composites(patterns="rope")
    (composites,) = parse_pipeline("composites{patterns=softmax}")
    assert composites == Composites(patterns="softmax")
    assert get_pass("composites") == Composites()
    assert set(PATTERN_GROUPS) == {"attention", "layer_norm", "rms_norm", "log_softmax",
                                   "softmax", "gelu", "gated_mlp", "silu"}


# ------------------------------------------------------------ exported from PyTorch
def _decompositions() -> dict:
    """The full default core-ATen table plus the ops core ATen keeps whole."""
    from torch._decomp import get_decompositions

    aten = torch.ops.aten
    table = dict(torch.export.default_decompositions())
    table.update(get_decompositions([aten.native_layer_norm, aten._softmax, aten._log_softmax,
                                     aten.gelu]))
    return table


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps)).to(x.dtype)


class LlamaLikeBlock(torch.nn.Module):
    """Pre-norm attention with a causal masked_fill, then a SiLU-gated MLP."""

    def __init__(self, dim: int = 32, heads: int = 2, hidden: int = 48):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.gate = torch.nn.Linear(dim, hidden, bias=False)
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        attn = scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _gpt2_eager():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16,
                        use_cache=False)
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config).eval()


class Functionals(torch.nn.Module):
    """One module calling every functional whose decomposition kiln recognizes."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.b = torch.nn.Parameter(torch.rand(8))

    def forward(self, x, q, k, v, m):
        return (
            F.layer_norm(x, (8,), self.w, self.b, 1e-5),
            F.layer_norm(x, (5, 8)),
            F.rms_norm(x, (8,), self.w, 1e-6),
            F.softmax(x, 1),
            F.log_softmax(x, -1),
            F.gelu(x),
            F.gelu(x, approximate="tanh"),
            F.silu(x),
            F.scaled_dot_product_attention(q, k, v),
            F.scaled_dot_product_attention(q, k, v, m),
            F.scaled_dot_product_attention(q, q, q, is_causal=True),
        )


EXPORTED = {
    "functionals": (Functionals, [(2, 5, 8), (1, 2, 4, 8), (1, 2, 6, 8), (1, 2, 6, 8), (4, 6)],
                    {"layer_norm": 2, "rms_norm": 1, "softmax": 1, "log_softmax": 1, "gelu": 2,
                     "silu": 1, "scaled_dot_product_attention": 3}),
    "llama_block": (LlamaLikeBlock, [(1, 6, 32)],
                    {"rms_norm": 2, "scaled_dot_product_attention": 1, "silu_mul": 1}),
    "gpt2_eager": (_gpt2_eager, [], {"layer_norm": 3, "gelu": 1, "scaled_dot_product_attention": 1}),
}
PIECES = {"amax", "exp", "erf", "tanh", "sigmoid", "rsqrt", "var", "mean", "silu"}


@pytest.mark.parametrize("name", list(EXPORTED))
def test_composites_come_back_from_fully_decomposed_exports(name):
    from kiln.frontends.torch.capture import capture_program

    build, shapes, expected = EXPORTED[name]
    torch.manual_seed(0)
    model = build().eval()
    args = tuple(torch.randn(s) for s in shapes) or (torch.randint(0, 50, (1, 8)),)
    program = torch.export.export(model, args).run_decompositions(_decompositions())
    captured = capture_program(program)
    graph = captured.graph
    result = Composites().run(graph)
    histogram = result.graph.op_histogram()
    assert {op: histogram.get(op, 0) for op in expected} == expected, histogram
    leftover = PIECES & set(histogram) - set(expected)
    assert not leftover, f"pieces of composites left: {leftover}"
    ir.verify(result.graph)
    assert not Composites().run(result.graph).changed
    params = [captured.params[p.name].detach().numpy() for p in graph.params]
    outputs = run_graph(result.graph, [a.numpy() for a in args], params)
    with torch.no_grad():
        eager = model(*args)
    eager = [t.numpy() for t in torch.utils._pytree.tree_leaves(eager)
             if isinstance(t, torch.Tensor)]
    assert len(outputs) == len(eager)
    for got, want in zip(outputs, eager):
        assert float(np.abs(got - want).max()) <= 1e-4 * max(float(np.abs(want).max()), 1e-6)
