"""Jaxprs to kiln graphs: :func:`capture_jaxpr` and the equation-by-equation lowering.

:class:`JaxprLowerer` walks a jaxpr's equations and calls each primitive's rule
(:mod:`kiln.frontends.jax.rules`) with a :class:`~kiln.frontends.jax.rules.JaxContext`,
then checks every result against the type JAX computed (a ``cast`` where only the dtype
differs; a shape difference raises :class:`~kiln.frontends.errors.CaptureError`).

* literals and a closed jaxpr's ``consts`` become kiln constants;
* sub-jaxprs (``jit``, ``cond``, ``scan``...) are lowered in place (:meth:`JaxprLowerer.inline`);
* an equation whose operands are all constants and whose results are small (an index
  computed from a ``scan`` counter, say) is evaluated by JAX itself and becomes a constant,
  so that rules see static indices where the program has them;
* every node's ``loc`` is the user's source line, ``"file.py:LINE in fn: code"``, from the
  equation's ``source_info`` (frames inside JAX and kiln are skipped; an equation inside a
  ``jnp`` function's own ``jit`` takes the line that called it);
* a primitive kiln has no rule for, a parameter combination a rule refuses, or a dtype kiln
  does not have raises :class:`~kiln.frontends.jax.errors.UnsupportedPrimitiveError`.
"""

from __future__ import annotations

import linecache
import os
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jcore
import numpy as np

from kiln.frontends.errors import CaptureError
from kiln.frontends.results import match_result
from kiln.ir import Graph, KilnError, OpTypeError, Value

from .errors import UnsupportedPrimitiveError
from .rules import JaxContext, aval_type, describe_aval, rule_for

FOLD_LIMIT = 64
"""Largest result (elements) of an all-constant equation that is folded into a constant."""


def _library_dirs() -> tuple[str, ...]:
    import jax
    import jaxlib

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dirs = [os.path.dirname(os.path.abspath(m.__file__)) for m in (jax, jaxlib)] + [here]
    return tuple(d + os.sep for d in dirs)


def source_location(eqn: Any) -> str | None:
    """``"file.py:LINE in fn: code"`` of the innermost user frame of ``eqn.source_info``."""
    traceback = getattr(eqn.source_info, "traceback", None)
    if traceback is None:
        return None
    skip = _library_dirs()
    for frame in traceback.frames:  # innermost first
        path = os.path.abspath(frame.file_name)
        if path.startswith(skip) or frame.file_name.startswith("<frozen"):
            continue
        code = linecache.getline(frame.file_name, frame.line_num).strip()
        return f"{os.path.basename(path)}:{frame.line_num} in {frame.function_name}: {code}"
    return None


def describe_eqn(eqn: Any) -> str:
    """The equation's operands as kiln types, then its short parameters (``axes=(1,)``)."""
    parts = [describe_aval(v.aval) for v in eqn.invars]
    for key, value in eqn.params.items():
        text = repr(value)
        if len(text) <= 60 and "\n" not in text and "Jaxpr" not in type(value).__name__:
            parts.append(f"{key}={text}")
    return ", ".join(parts)


def _bad_dtype(eqn: Any) -> str | None:
    for what, atoms in (("operand", eqn.invars), ("result", eqn.outvars)):
        for i, atom in enumerate(atoms):
            aval = atom.aval
            if not hasattr(aval, "dtype"):
                return f"{what} {i} is {aval}, not an array"
            try:
                aval_type(aval)
            except ValueError as e:
                return f"{what} {i} ({aval}): {e}"
    return None


class JaxprLowerer:
    """Lowers the equations of jaxprs into one kiln graph."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._outer: list[str | None] = []
        """Locations of the equations whose sub-jaxprs are being lowered: an inner equation
        whose own traceback stops inside JAX (a ``jnp`` function's ``jit``) takes the
        innermost of them."""

    def inline(self, jaxpr: Any, args: Sequence[Value]) -> list[Value]:
        """The outputs of ``jaxpr`` (a ``ClosedJaxpr`` or an open ``Jaxpr``) on ``args``."""
        consts = getattr(jaxpr, "consts", [])
        return self.run(getattr(jaxpr, "jaxpr", jaxpr), consts, args)

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Value]) -> list[Value]:
        env: dict[Any, Value] = {}
        for var, const in zip(jaxpr.constvars, consts):
            env[var] = self.constant(const, var.aval)
        for var, arg in zip(jaxpr.invars, args):
            env[var] = arg
        for eqn in jaxpr.eqns:
            self.lower(eqn, env)
        return [self.read(env, atom) for atom in jaxpr.outvars]

    def constant(self, data: Any, aval: Any) -> Value:
        kind = aval_type(aval)
        return self.graph.add_constant(np.asarray(data).astype(kind.dtype.numpy), kind.dtype)

    def read(self, env: dict[Any, Value], atom: Any) -> Value:
        if isinstance(atom, jcore.Literal):
            return self.constant(atom.val, atom.aval)
        return env[atom]

    def lower(self, eqn: Any, env: dict[Any, Value]) -> None:
        name = eqn.primitive.name
        loc = source_location(eqn) or next((o for o in reversed(self._outer) if o), None)
        rule = rule_for(name)
        reason = _bad_dtype(eqn)
        if rule is None or reason is not None or rule.check is not None:
            reason = reason or (rule.check(eqn) if rule is not None else None)
            if rule is None or reason is not None:
                raise UnsupportedPrimitiveError(name, describe_eqn(eqn), loc, reason)
        args = [self.read(env, atom) for atom in eqn.invars]
        results = None if rule.control else self._fold(eqn, args)
        if results is None:
            results = self._apply(rule, eqn, args, loc)
        if len(results) != len(eqn.outvars):
            raise CaptureError(f"kiln's rule for JAX primitive {name} made {len(results)} results, "
                               f"JAX has {len(eqn.outvars)}\n  at {loc or '<unknown source line>'}")
        for var, value in zip(eqn.outvars, results):
            if not isinstance(var, jcore.DropVar):
                env[var] = self._match(eqn, value, var.aval, loc)

    def _apply(self, rule: Any, eqn: Any, args: list[Value], loc: str | None) -> list[Value]:
        ctx = JaxContext(self.graph, eqn, loc, self.inline)
        self._outer.append(loc)
        try:
            result = rule.lower(ctx, *args, **eqn.params)
        except KilnError as e:
            if not isinstance(e, OpTypeError):
                raise  # an unsupported primitive inside a sub-jaxpr names itself
            raise self._bug(eqn, loc, e) from e
        except (ValueError, TypeError) as e:
            raise self._bug(eqn, loc, e) from e
        finally:
            self._outer.pop()
        return [result] if isinstance(result, Value) else list(result)

    def _bug(self, eqn: Any, loc: str | None, error: Exception) -> CaptureError:
        return CaptureError(
            f"kiln failed to lower JAX primitive {eqn.primitive.name}({describe_eqn(eqn)}): {error}\n"
            f"  at {loc or '<unknown source line>'}\n  This is a kiln bug; please report it with "
            "the primitive and operand types above.")

    def _fold(self, eqn: Any, args: list[Value]) -> list[Value] | None:
        """JAX's own result for an all-constant equation with small results, else ``None``."""
        if any(not v.is_const for v in args):
            return None
        if any(int(np.prod(v.aval.shape)) > FOLD_LIMIT for v in eqn.outvars):
            return None
        try:
            out = eqn.primitive.bind(*[np.asarray(v.data) for v in args], **eqn.params)
        except Exception:  # noqa: BLE001  (folding is an optimization; the rule still applies)
            return None
        outs = out if eqn.primitive.multiple_results else [out]
        return [self.constant(np.asarray(o), var.aval) for o, var in zip(outs, eqn.outvars)]

    def _match(self, eqn: Any, value: Value, aval: Any, loc: str | None) -> Value:
        """Check ``value`` against JAX's result type; cast when only the dtype differs."""
        return match_result(self.graph, value, aval_type(aval),
                            f"JAX primitive {eqn.primitive.name}({describe_eqn(eqn)})", "JAX", loc)


def capture_jaxpr(closed_jaxpr: Any, *, name: str = "main",
                  input_names: Sequence[str] | None = None) -> Graph:
    """The kiln graph of a ``ClosedJaxpr``: one graph input per jaxpr input (named
    ``input_names``, default ``x0, x1, ...``), one output per jaxpr output."""
    from .rules import check_jax_version

    check_jax_version()
    jaxpr = closed_jaxpr.jaxpr
    names = list(input_names) if input_names is not None else [f"x{i}" for i in range(len(jaxpr.invars))]
    graph = Graph(name)
    inputs = []
    for i, (var, input_name) in enumerate(zip(jaxpr.invars, names)):
        try:
            inputs.append(graph.add_input(input_name, aval_type(var.aval)))
        except ValueError as e:
            raise UnsupportedPrimitiveError(
                "<input>", describe_aval(var.aval), None, f"input {i} ({var.aval}): {e}",
                hint="Pass float, integer or bool arrays of static shape.") from e
    graph.set_outputs(JaxprLowerer(graph).inline(closed_jaxpr, inputs))
    return graph
