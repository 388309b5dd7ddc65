"""One fused group of each kernel kind, with the Triton source the backend generates for it.

``python -m kiln.backends.triton.examples`` prints, per kind, the graph IR of the group
(after kiln's default pipeline fused it), its lowered loop program where the kernel comes
from one, and the kernel's part of the generated module for a GPU (``interpret=False``; no
GPU is needed to generate it).  ``docs/triton.md`` shows this output.
"""

from __future__ import annotations

import sys

from kiln.ir import Graph, parse

EXAMPLES: dict[str, str] = {
    "pointwise": """graph @bias_gelu(%x: f32[1000], %y: f32[1000]) {
  %0: f32[1000] = add(%x, %y)
  %1: f32[1000] = gelu(%0) {approximate="tanh"}
  return %1
}""",
    "reduction": """graph @add_layer_norm(%x: f32[16, 768], %r: f32[16, 768], %w: f32[768], %b: f32[768]) {
  %0: f32[16, 768] = add(%x, %r)
  %1: f32[16, 768] = layer_norm(%0, %w, %b) {normalized_rank=1}
  return %1
}""",
    "matmul": """graph @linear_relu(%x: f32[128, 70], %w: f32[96, 70], %b: f32[96]) {
  %0: f32[70, 96] = permute(%w) {dims=[1, 0]}
  %1: f32[128, 96] = matmul(%x, %0)
  %2: f32[128, 96] = add(%1, %b)
  %3: f32[128, 96] = relu(%2)
  return %3
}""",
    "attention": """graph @causal_attention(%q: bf16[2, 4, 128, 64], %k: bf16[2, 4, 128, 64], %v: bf16[2, 4, 128, 64]) {
  %0: bf16[2, 4, 128, 64] = scaled_dot_product_attention(%q, %k, %v) {is_causal=true}
  return %0
}""",
}
"""Kind -> a small graph whose one kernel has that kind (the general kind: :data:`GENERAL`)."""

GENERAL = """program running_sum() {
  buffer x: f32[300]
  buffer y: f32[300]
  buffer s: f32[] local
  S0: s[] = 0.0:f32
  for i in [0, 300) {
    S1: s[] += x[i]
    S2: y[i] = s[]
  }
}"""
"""A loop program no template or vector nest matches: the general kernel runs its loop
sequentially (a running sum whose accumulator is read inside the loop)."""


def fused(text: str) -> Graph:
    from kiln.passes.pipeline import default_pipeline  # noqa: PLC0415

    return default_pipeline()(parse(text)).graph


def example(kind: str) -> tuple[str, str, str]:
    """``(graph IR, loop program or "", generated kernel source)`` of the example of ``kind``."""
    from kiln.passes.lower import lower_node  # noqa: PLC0415

    from .generate import kernel_source, program_source  # noqa: PLC0415

    if kind == "general":
        from kiln.ir.loops.text import parse_program  # noqa: PLC0415

        program = parse_program(GENERAL)
        source = program_source(program, ["x", "y"], interpret=False, symbol="kiln_k0", comment="running sum")
        return "", str(program), source.render()
    graph = fused(EXAMPLES[kind])
    node = next(n for n in graph.nodes if not n.op.has("view"))
    source = kernel_source(node, interpret=False, symbol="kiln_k0", comment=f"{kind} example")
    program = "" if kind == "attention" else str(lower_node(node).program)
    return str(graph), program, source.render()


def main(argv: list[str] | None = None) -> int:
    kinds = (argv if argv is not None else sys.argv[1:]) or [*EXAMPLES, "general"]
    for kind in kinds:
        graph, program, source = example(kind)
        print(f"## {kind}\n")
        if graph:
            print(f"```\n{graph}\n```\n")
        if program:
            print(f"```\n{program}\n```\n")
        print(f"```python\n{source.rstrip()}\n```\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["EXAMPLES", "GENERAL", "example", "main"]
