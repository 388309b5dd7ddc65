"""PyTorch's symbolic sizes as kiln sizes.

torch.export and Dynamo describe a dynamic dimension by a ``torch.SymInt`` whose
``node.expr`` is a sympy expression of shape-environment symbols (``s0``, ``s77``) built
with torch's own functions (``FloorDiv``, ``CeilDiv``, ``PythonMod``, ``ModularIndexing``,
``Max``...).  :func:`to_dim` turns such a size -- or a plain int -- into a kiln ``Dim``:
each symbol becomes a named kiln size (:class:`~kiln.ir.SymDim`), named after the user's
``torch.export.Dim`` where capture knows it (:func:`naming`), else after torch's symbol
(``s0``); torch's functions become the ones kiln's size expressions use (``floor``,
``ceiling``, ``Mod``, ``Max``, ``Min``).

:func:`size_ranges` reads the range of each symbol (``ExportedProgram.range_constraints``,
or a ShapeEnv's ``var_to_range`` under Dynamo) as :class:`~kiln.ir.types.SizeRange`.  kiln's
named sizes are at least 2 (``MIN_SIZE``): sizes 0 and 1 are specialized by torch and by
kiln (a size-1 axis broadcasts), so a range that starts lower is recorded from 2, and a call
with size 0 or 1 is refused by the compiled graph's guard.

Unbacked sizes (``u0``: computed from tensor data) are refused by capture before they get
here (:mod:`kiln.frontends.torch.aten_support`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

import sympy
import torch

from kiln.ir.types import MIN_SIZE, SizeRange, SymDim, as_dim, size_symbol

_NAMES: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("kiln_size_names",
                                                                              default=None)


@contextlib.contextmanager
def naming(names: Mapping[str, str]) -> Iterator[None]:
    """While active, torch symbol ``names``' keys (``"s77"``) become kiln sizes named by
    their values (``"batch"``); other symbols keep torch's name."""
    token = _NAMES.set(dict(names))
    try:
        yield
    finally:
        _NAMES.reset(token)


def size_name(symbol: sympy.Symbol) -> str:
    """The kiln name of torch shape symbol ``symbol``."""
    names = _NAMES.get() or {}
    return names.get(symbol.name, symbol.name)


def is_symbolic(x: Any) -> bool:
    """Whether ``x`` is a torch symbolic integer whose value is not fixed."""
    return isinstance(x, torch.SymInt) and not isinstance(_expr(x), sympy.Integer)


def _expr(x: torch.SymInt) -> sympy.Expr:
    return x.node.expr


def to_dim(x: Any) -> int | SymDim:
    """A kiln ``Dim`` from an int, a ``torch.SymInt``, a kiln SymDim or a torch sympy
    expression."""
    if isinstance(x, SymDim):
        return x
    if isinstance(x, torch.SymInt):
        expr = _simplified(x)
        if isinstance(expr, sympy.Integer) or getattr(expr, "is_number", False):
            return int(expr)
        return size_value(kiln_expr(expr))
    if isinstance(x, sympy.Expr):
        return as_dim(kiln_expr(x))
    if isinstance(x, bool):
        raise TypeError(f"size {x!r} is a bool, not an int")
    return int(x)


def _simplified(x: torch.SymInt) -> sympy.Expr:
    """``x``'s expression with the ShapeEnv's replacements applied (``s1`` found equal to
    ``s0`` is ``s0``), so one size has one kiln name."""
    expr = x.node.expr
    env = getattr(x.node, "shape_env", None)
    if env is not None and hasattr(env, "replace"):
        try:
            expr = env.replace(expr)
        except Exception:  # noqa: BLE001 - a ShapeEnv that cannot replace: keep the raw expression
            pass
    return expr


def size_value(expr: sympy.Expr) -> int | SymDim:
    """A kiln size expression as a ``Dim``; unlike a dimension, a size *value* (a slice
    bound, an offset) may be negative (``-seq``)."""
    try:
        return as_dim(expr)
    except ValueError:
        expr = sympy.expand(expr)
        return int(expr) if expr.is_Integer else SymDim(expr)


def kiln_expr(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` (torch's sympy) over kiln's named-size symbols and functions."""
    from torch.utils._sympy import functions as F

    if isinstance(expr, sympy.Symbol):
        if expr.name.startswith(("u", "q")) and expr.name[1:].isdigit():
            raise ValueError(f"size {expr} is data-dependent (unbacked); kiln needs sizes that follow "
                             "from the input shapes")
        return size_symbol(size_name(expr))
    if isinstance(expr, (sympy.Integer, sympy.Rational)) or not expr.args:
        return expr
    args = [kiln_expr(a) for a in expr.args]
    if isinstance(expr, F.FloorDiv):
        return sympy.floor(args[0] / args[1])
    if isinstance(expr, F.CleanDiv):
        return args[0] / args[1]
    if isinstance(expr, F.CeilDiv):
        return sympy.ceiling(args[0] / args[1])
    if isinstance(expr, (F.PythonMod, F.Mod)):
        return sympy.Mod(args[0], args[1])
    if isinstance(expr, F.ModularIndexing):
        return sympy.Mod(sympy.floor(args[0] / args[1]), args[2])
    if isinstance(expr, F.Max):
        return sympy.Max(*args)
    if isinstance(expr, F.Min):
        return sympy.Min(*args)
    if isinstance(expr, (F.FloorToInt,)):
        return sympy.floor(args[0])
    if isinstance(expr, (F.CeilToInt,)):
        return sympy.ceiling(args[0])
    if isinstance(expr, F.PowByNatural):
        return args[0] ** args[1]
    if isinstance(expr, (sympy.Add, sympy.Mul, sympy.Pow, sympy.floor, sympy.ceiling, sympy.Mod)):
        return expr.func(*args)
    raise ValueError(f"size expression {expr} uses {type(expr).__name__}, which kiln's sizes do not "
                     "have (kiln has +, -, *, floor, ceiling, Mod, Max, Min)")


def _bound(value: Any) -> int | None:
    """An int bound of a torch ValueRange, ``None`` for an infinite one."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, sympy.Integer):
        return int(value)
    return None  # sympy.oo, torch's int_oo, or a non-integer bound


def size_ranges(var_to_range: Mapping[Any, Any], symbols: set[str] | None = None) -> dict[str, SizeRange]:
    """kiln size name -> :class:`SizeRange` of every symbol of ``var_to_range`` (torch's
    ``ValueRanges``: ``.lower``/``.upper``), limited to ``symbols`` (kiln names) when given.
    Lower bounds below ``MIN_SIZE`` are raised to it (see the module docstring)."""
    out: dict[str, SizeRange] = {}
    for sym, vr in var_to_range.items():
        if not isinstance(sym, sympy.Symbol):
            continue
        name = size_name(sym)
        if symbols is not None and name not in symbols:
            continue
        lo = _bound(getattr(vr, "lower", None))
        hi = _bound(getattr(vr, "upper", None))
        lo = MIN_SIZE if lo is None or lo < MIN_SIZE else lo
        if hi is not None and hi < lo:
            raise ValueError(f"size {name} has the range [{vr.lower}, {vr.upper}], which holds no "
                             f"size >= {MIN_SIZE}; kiln specializes sizes 0 and 1: make that axis static")
        out[name] = SizeRange(lo, hi)
    return out


def shape_env_of(values: Any) -> Any:
    """The ShapeEnv behind the first symbolic size among ``values`` (tensors' shapes and
    SymInts, nested in lists), or ``None``."""
    stack = list(values) if isinstance(values, (list, tuple)) else [values]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.SymInt):
            return v.node.shape_env
        if isinstance(v, torch.Tensor):
            stack.extend(d for d in v.shape if isinstance(d, torch.SymInt))
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return None


def dim_names(dynamic_shapes: Any, flat_inputs: list[Any], in_spec: Any) -> dict[tuple[int, int], str]:
    """``(flat user input index, axis) -> Dim name`` of every axis the user named with a
    ``torch.export.Dim`` in ``dynamic_shapes`` (torch.export's argument).  ``Dim.AUTO`` /
    ``Dim.DYNAMIC`` have no name, and axes they mark keep torch's symbol names."""
    if dynamic_shapes is None:
        return {}
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_leaves(dynamic_shapes, is_leaf=_is_axis_spec)
    tensors = [i for i, x in enumerate(flat_inputs) if isinstance(x, torch.Tensor)]
    out: dict[tuple[int, int], str] = {}
    specs = [s for s in leaves if _is_axis_spec(s)]
    if len(specs) != len(tensors):
        return out
    for index, spec in zip(tensors, specs):
        items = spec.items() if isinstance(spec, dict) else enumerate(spec or ())
        for axis, dim in items:
            name = getattr(dim, "__name__", None)
            if isinstance(name, str) and name.isidentifier() and not _is_hint(dim):
                out[(index, int(axis))] = name
    return out


def _is_hint(dim: Any) -> bool:
    return type(dim).__name__ == "_DimHint" or dim is None


def _is_axis_spec(x: Any) -> bool:
    """A per-tensor entry of ``dynamic_shapes``: ``None``, ``{axis: Dim}`` or a list of Dims."""
    if x is None:
        return True
    if isinstance(x, dict):
        return all(isinstance(k, int) for k in x)
    if isinstance(x, (list, tuple)):
        return all(v is None or _is_dim(v) for v in x) and len(x) > 0
    return False


def _is_dim(v: Any) -> bool:
    return isinstance(v, int) or _is_hint(v) or hasattr(v, "min") and hasattr(v, "max") \
        or type(v).__name__ in ("_Dim", "_DerivedDim", "Dim", "_StaticDim")


def describe_dynamic_shapes(spec: Any) -> str:
    """A canonical text of torch.export's ``dynamic_shapes`` argument (for cache keys):
    ``Dim`` objects by name and range, hints by name, nests by structure."""
    if spec is None:
        return "none"
    if _is_hint(spec):
        return f"hint {getattr(spec, 'name', spec)}"
    if isinstance(spec, dict):
        return "{" + ", ".join(f"{k!r}: {describe_dynamic_shapes(v)}" for k, v in spec.items()) + "}"
    if isinstance(spec, (list, tuple)):
        return type(spec).__name__ + "[" + ", ".join(describe_dynamic_shapes(v) for v in spec) + "]"
    if isinstance(spec, int):
        return str(spec)
    name = getattr(spec, "__name__", None)
    if name is not None and hasattr(spec, "min"):
        root = getattr(spec, "root", None)
        derived = f" from {describe_dynamic_shapes(root)} by {getattr(spec, 'fn', None)!r}" if root else ""
        return f"Dim({name}, {getattr(spec, 'min', None)}, {getattr(spec, 'max', None)}){derived}"
    return f"{type(spec).__name__} {spec!r}"
