"""Graphs in kiln's text form that exercise one kernel kind each, shared by the tests of the
code-generating backends (each builds them and compares with the reference backend)."""

from __future__ import annotations


def _tensor(shape) -> str:
    return f"f32[{', '.join(map(str, shape))}]"


def elementwise(shape) -> str:
    """A bias add and a chain of unary math: one pointwise kernel."""
    t = _tensor(shape)
    return f"""
graph @ew(%x: {t}, %y: {t}, %b: f32[{shape[-1]}]) {{
  %0: {t} = mul(%x, %y)
  %1: {t} = add(%0, %b)
  %2: {t} = gelu(%1) {{approximate="tanh"}}
  %3: {t} = tanh(%2)
  %4: {t} = exp(%3)
  return %4
}}"""


def reduction(shape) -> str:
    """Row sums and maxima, softmax, layer norm and a full mean over the last axis."""
    t, kept, last = _tensor(shape), f"f32[{', '.join(map(str, shape[:-1]))}, 1]", shape[-1]
    return f"""
graph @red(%x: {t}, %w: f32[{last}], %b: f32[{last}]) {{
  %0: {kept} = sum(%x) {{dims=[-1], keepdim=true}}
  %1: {t} = sub(%x, %0)
  %2: {kept} = amax(%1) {{dims=[-1], keepdim=true}}
  %3: {t} = add(%1, %2)
  %4: {t} = softmax(%3) {{dim=-1}}
  %5: {t} = layer_norm(%4, %w, %b) {{normalized_rank=1}}
  %6: f32[] = mean(%5)
  return %5, %6
}}"""


def matmul_epilogue(m: int, k: int, n: int) -> str:
    """A linear layer (transposed weight, bias) and a ReLU epilogue, batch 2."""
    return f"""
graph @mm(%x: f32[2, {m}, {k}]) params(%w: f32[{n}, {k}], %b: f32[{n}]) {{
  %0: f32[{k}, {n}] = permute(%w) {{dims=[1, 0]}}
  %1: f32[2, {m}, {n}] = matmul(%x, %0)
  %2: f32[2, {m}, {n}] = add(%1, %b)
  %3: f32[2, {m}, {n}] = relu(%2)
  return %3
}}"""


def conv_block(stride: int, groups: int, *, pool: bool = False) -> str:
    """A 3x3 convolution of a 17x17 image, a per-channel scale and a ReLU, and with ``pool``
    a 2x2 max pool."""
    out = (17 + 2 - 3) // stride + 1
    pooled = (out - 2) // 2 + 1
    tail = (f"  %3: f32[1, 6, {pooled}, {pooled}] = max_pool2d(%2) {{kernel=[2, 2], stride=[2, 2]}}\n"
            "  return %3" if pool else "  return %2")
    return f"""
graph @conv(%x: f32[1, 3, 17, 17]) params(%w: f32[6, {3 // groups}, 3, 3], %b: f32[6], %s: f32[6, 1, 1]) {{
  %0: f32[1, 6, {out}, {out}] = conv(%x, %w, %b) {{stride=[{stride}, {stride}], padding=[1, 1], dilation=[1, 1], groups={groups}}}
  %1: f32[1, 6, {out}, {out}] = mul(%0, %s)
  %2: f32[1, 6, {out}, {out}] = relu(%1)
{tail}
}}"""
