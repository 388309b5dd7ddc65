"""Automatic mixed precision: the ``amp`` pass and dynamic loss scaling.

The ``amp`` pass (``amp{dtype=bf16}`` or ``amp{dtype=f16}`` in pipeline text) rewrites a
graph to compute in a low-precision float type where that is safe, following the per-op
policy declared with each op (``defop(..., amp=...)``):

=============  ==================================================================
policy         what the pass does
=============  ==================================================================
``"low"``      float32 operands are cast to the low dtype; the op computes and
               returns low precision (matmul, conv, attention: the FLOPs).
``"float32"``  low-precision operands are cast up to float32; the op computes in
               float32 (reductions, softmax/log_softmax, norms, exp/log/pow...).
``None``       *follow*: the op computes in the widest float dtype among its
               float operands (narrower ones are cast up to it); a lone dtype is
               kept (elementwise math, views, layout, embedding...).
=============  ==================================================================

Guarantees:

* The graph's signature is unchanged: inputs and params keep their types (float32 master
  weights stay float32; casts happen inside the graph) and every output is cast back to its
  original dtype where the rewrite changed it.
* float64 values are never lowered; integer and bool operands are never cast.
* Explicit ``cast`` nodes keep their target dtype.
* Each value is cast to a given dtype at most once (casts are shared by all users).
* Casts are simplified without changing results: a cast to the value's own dtype is removed,
  and ``cast(cast(x, A), B)`` becomes ``cast(x, B)`` (or ``x`` when ``B`` is ``x``'s dtype)
  only when ``A`` holds every value of ``x``'s dtype exactly (e.g. bf16 -> f32 -> bf16).
  ``cast(cast(x: f32, f16), f32)`` is a rounding and is kept.
* Nested graphs (``fused`` bodies) are not rewritten: run ``amp`` before ``fuse``.
* The input graph is not modified.

Dynamic loss scaling for float16 (used by :func:`kiln.compile_train`):
:func:`scale_loss` multiplies the loss by a ``loss_scale`` input before differentiation,
:func:`unscale_gradients` divides the gradients back and adds a ``bool[]`` output that is
true when any gradient is inf or NaN (the optimizer update is then skipped), and
:class:`LossScaler` keeps the scale on the host with ``torch.amp.GradScaler``'s rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from kiln.ir import DType, Graph, KilnError, Node, TensorType, Value
from kiln.ir.names import claim_name, unique_name
from kiln.passes.base import Pass, PassResult, register_pass
from kiln.passes.dce import DeadCodeElimination

POLICIES = ("low", "float32", "follow", None)
"""Known policies; ``"follow"`` and ``None`` (the default) mean the same."""
_LOW = (DType.float16, DType.bfloat16)
_DTYPE_NAMES = {"bf16": DType.bfloat16, "bfloat16": DType.bfloat16,
                "f16": DType.float16, "float16": DType.float16, "half": DType.float16}


def low_dtype(name: str | DType) -> DType:
    """``"bf16"``/``"bfloat16"`` or ``"f16"``/``"float16"``/``"half"`` as a DType."""
    if isinstance(name, DType) and name in _LOW:
        return name
    try:
        return _DTYPE_NAMES[str(name).lower()]
    except KeyError:
        raise KilnError(f"kiln amp: unknown low-precision dtype {name!r}; use one of "
                        f"{', '.join(sorted(_DTYPE_NAMES))}") from None


# ------------------------------------------------------------------- exactness
_MANTISSA = {DType.float16: 11, DType.bfloat16: 8, DType.float32: 24, DType.float64: 53}
_EXPONENT = {DType.float16: 5, DType.bfloat16: 8, DType.float32: 8, DType.float64: 11}


def holds_exactly(src: DType, dst: DType) -> bool:
    """Whether every value of ``src`` is exactly representable in ``dst`` (floats only)."""
    if src == dst:
        return True
    if src not in _MANTISSA or dst not in _MANTISSA:
        return False
    return _MANTISSA[src] <= _MANTISSA[dst] and _EXPONENT[src] <= _EXPONENT[dst]


def _widest(dtypes: set[DType]) -> DType:
    if len(dtypes) == 1:
        return next(iter(dtypes))
    if DType.float64 in dtypes:
        return DType.float64
    if DType.float32 in dtypes or dtypes >= set(_LOW):
        return DType.float32  # f16 and bf16 together: neither holds the other
    return next(iter(dtypes))


# ------------------------------------------------------------------------ pass
@register_pass
@dataclass(frozen=True)
class AutoMixedPrecision(Pass):
    """Insert casts so ops run in ``dtype`` per their amp policy (see the module docstring)."""

    name: ClassVar[str] = "amp"
    dtype: str = "bf16"

    def run(self, graph: Graph) -> PassResult:
        rewriter = _Rewriter(graph, low_dtype(self.dtype))
        rewritten = rewriter.rewrite()
        if not rewriter.casts:  # nothing to lower: the rewrite is a plain copy
            rewritten = graph
        result = simplify_casts(rewritten)
        changed = result is not graph
        return PassResult(result, changed)


class _Rewriter:
    def __init__(self, graph: Graph, low: DType):
        self.src = graph
        self.low = low
        self.g = Graph(graph.name)
        self.vmap: dict[Value, Value] = {}
        self.casts: dict[tuple[Value, DType], Value] = {}
        self.taken = {v.name for v in graph.values()}

    def rewrite(self) -> Graph:
        for v in self.src.inputs:
            self.vmap[v] = self.g.add_input(v.name, v.type)
        for v in self.src.params:
            self.vmap[v] = self.g.add_param(v.name, v.type)
        for c in self.src.constants:
            self.vmap[c] = self.g.add_constant(c.data, c.dtype, c.name, dedup=False)
        for node in self.src.nodes:
            self._node(node)
        self.g.set_outputs([self.cast(self.vmap[v], v.dtype, v.name) for v in self.src.outputs])
        return self.g

    def _node(self, node: Node) -> None:
        operands = [self.vmap[v] for v in node.inputs]
        if node.op_name != "cast":
            operands = self._apply_policy(node, operands)
        new = self.g.add_node(node.op, operands, node.attrs, names=[v.name for v in node.outputs],
                              loc=node.loc)
        self.vmap.update(zip(node.outputs, new.outputs))

    def _apply_policy(self, node: Node, operands: list[Value]) -> list[Value]:
        policy = node.op.amp
        if policy not in POLICIES:
            raise KilnError(f"kiln amp: op '{node.op_name}' declares unknown amp policy {policy!r}; "
                            f"known: 'low', 'float32', 'follow' (or None)")
        if policy == "low":
            return [self.cast(v, self.low) if v.dtype.is_floating and v.dtype != DType.float64 else v
                    for v in operands]
        if policy == "float32":
            return [self.cast(v, DType.float32) if v.dtype in _LOW else v for v in operands]
        floats = {v.dtype for v in operands if v.dtype.is_floating}
        if len(floats) < 2:
            return operands
        target = _widest(floats)
        return [self.cast(v, target) if v.dtype.is_floating else v for v in operands]

    def cast(self, value: Value, dtype: DType, hint: str | None = None) -> Value:
        """``value`` as ``dtype``, sharing one cast node per (value, dtype)."""
        if value.dtype == dtype:
            return value
        key = (value, dtype)
        if key not in self.casts:
            name = self._name(hint or f"{value.name}_{dtype.short}")
            node = self.g.add_node("cast", [value], {"dtype": dtype}, names=[name], loc="amp")
            self.casts[key] = node.output
        return self.casts[key]

    def _name(self, hint: str) -> str:
        if not hint[0].isalpha() and hint[0] != "_":
            hint = "v" + hint  # numeric names may not take suffixes
        return claim_name(hint, self.taken)


def simplify_casts(graph: Graph) -> Graph:
    """``graph`` with no-op casts and exactly-representable cast chains removed (see the
    module docstring), and the casts this leaves unused deleted.  Returns the input graph
    itself when there is nothing to simplify."""
    if not any(n.op_name == "cast" for n in graph.nodes):
        return graph
    g = graph.clone()
    producer = {v: n for n in g.nodes for v in n.outputs}
    changed = False
    for node in g.nodes:
        if node.op_name != "cast":
            continue
        source = node.inputs[0]
        target = node.attrs["dtype"]
        inner = producer.get(source)
        while inner is not None and inner.op_name == "cast" \
                and holds_exactly(inner.inputs[0].dtype, source.dtype):
            source = inner.inputs[0]  # the inner cast was exact: skip it
            inner = producer.get(source)
        if source.dtype == target:
            g.replace_all_uses(node.output, source)
            changed = True
        elif source is not node.inputs[0]:
            node.inputs = (source,)
            changed = True
    if not changed:
        return graph
    return _drop_dead(g)


def _drop_dead(g: Graph) -> Graph:
    return DeadCodeElimination().run(g).graph


# ---------------------------------------------------------------- loss scaling
LOSS_SCALE_INPUT = "loss_scale"


def scale_loss(graph: Graph, loss: int = 0) -> tuple[Graph, int]:
    """A copy of ``graph`` with an ``f32[]`` input ``loss_scale`` and one more output,
    ``loss * loss_scale``; returns the graph and the index of that output (seed autodiff
    with it).  The loss itself stays an output."""
    out = graph.outputs[loss] if 0 <= loss < len(graph.outputs) else None
    if out is None or out.type.rank != 0 or not out.dtype.is_floating:
        raise KilnError(f"kiln: loss output {loss} of graph @{graph.name} must be a floating "
                        f"scalar, got {out.type if out is not None else 'nothing'}")
    g = graph.clone()
    taken = {v.name for v in g.values()}
    scale = g.add_input(unique_name(LOSS_SCALE_INPUT, taken), TensorType((), DType.float32))
    loss_value = g.outputs[loss]
    scaled = g.op("mul", g.op("cast", loss_value, dtype=DType.float32, loc="amp")
                  if loss_value.dtype != DType.float32 else loss_value, scale, loc="amp")
    g.set_outputs([*g.outputs, scaled])
    return g, len(g.outputs) - 1


def unscale_gradients(graph: Graph, grads: Sequence[int], scale_input: str) -> tuple[Graph, int]:
    """A copy of ``graph`` whose outputs at ``grads`` are divided by the input named
    ``scale_input`` (as PyTorch does: multiplied by its float32 reciprocal), plus one
    ``bool[]`` output, true when any unscaled gradient has an inf or NaN; returns the graph
    and the index of that output."""
    g = graph.clone()
    scale = next((v for v in g.inputs if v.name == scale_input), None)
    if scale is None:
        raise KilnError(f"kiln: graph @{graph.name} has no input '{scale_input}'")
    inverse = g.op("reciprocal", scale, loc="amp")
    outputs = list(g.outputs)
    bad: Value | None = None
    for index in grads:
        grad = outputs[index]
        unscaled = g.op("mul", grad if grad.dtype == DType.float32 else
                        g.op("cast", grad, dtype=DType.float32, loc="amp"), inverse, loc="amp")
        flag = g.op("logical_or", g.op("any", g.op("isinf", unscaled, loc="amp"), loc="amp"),
                    g.op("any", g.op("isnan", unscaled, loc="amp"), loc="amp"), loc="amp")
        bad = flag if bad is None else g.op("logical_or", bad, flag, loc="amp")
        outputs[index] = unscaled if grad.dtype == DType.float32 else \
            g.op("cast", unscaled, dtype=grad.dtype, loc="amp")
    if bad is None:
        bad = g.add_constant(False, DType.bool)
    g.set_outputs([*outputs, bad])
    return g, len(outputs)


@dataclass
class LossScaler:
    """Dynamic loss scale with ``torch.amp.GradScaler``'s defaults and update rule.

    After each step call :meth:`update` with whether the gradients had an inf/NaN: the scale
    is multiplied by ``backoff_factor`` and the good-step count reset when they had, else
    the count grows and every ``growth_interval`` good steps the scale is multiplied by
    ``growth_factor``.
    """

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    scale: float = field(default=0.0)
    growth_tracker: int = 0
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        if self.growth_factor <= 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise KilnError("kiln: LossScaler needs growth_factor > 1 and 0 < backoff_factor < 1")
        if self.growth_interval < 1:
            raise KilnError("kiln: LossScaler needs growth_interval >= 1")
        if not self.scale:
            self.scale = float(self.init_scale)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0
