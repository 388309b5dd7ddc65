"""Shared checks for before/after IR-text pass tests."""

from __future__ import annotations

import re

import numpy as np

import kiln.ir as ir
from kiln.backends.reference import run_graph
from kiln.ir import DType, Graph
from kiln.passes import Pass


def canon(g: Graph) -> str:
    """The text of ``g`` with constant and node-result names renumbered in definition order,
    so graphs equal up to value names print the same."""
    names = [v.name for v in [*g.constants, *(o for n in g.nodes for o in n.outputs)]]
    mapping = {n: f"#{i}" for i, n in enumerate(names)}
    return re.sub(r"%([A-Za-z0-9_.]+)", lambda m: "%" + mapping.get(m.group(1), m.group(1)), str(g))


def random_arrays(values, rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for v in values:
        dt = v.dtype
        if dt.is_floating:
            out.append(rng.standard_normal(v.shape).astype(dt.numpy))
        elif dt == DType.bool:
            out.append(rng.random(v.shape) > 0.5)
        else:
            out.append(rng.integers(0 if dt == DType.uint8 else -5, 6, v.shape).astype(dt.numpy))
    return out


def assert_same_outputs(before: Graph, after: Graph, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    inputs, params = random_arrays(before.inputs, rng), random_arrays(before.params, rng)
    with np.errstate(all="ignore"):
        want = run_graph(before, inputs, params)
        got = run_graph(after, inputs, params)
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-6, atol=1e-6)


def check(p: Pass, before: str, expected: str | None) -> Graph:
    """Run ``p`` on ``before``; compare with ``expected`` (None = unchanged), verify, compare
    outputs on random inputs, and check that a second run changes nothing."""
    g = ir.parse(before)
    result = p.run(g)
    want = ir.parse(expected) if expected is not None else g
    assert canon(result.graph) == canon(want)
    assert result.changed == (expected is not None)
    ir.verify(result.graph)
    assert_same_outputs(g, result.graph)
    assert not p.run(result.graph).changed
    return result.graph
