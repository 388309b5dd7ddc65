"""Compile JAX functions with kiln: :func:`jit`, :func:`grad` and :func:`value_and_grad`.

::

    import kiln.jax

    fast = kiln.jax.jit(f)                       # like jax.jit(f): same call, same pytree out
    fast(x, params)                              # jax.Arrays out (outputs="numpy": numpy arrays)
    dparams = kiln.jax.grad(loss, argnums=1)(x, params)      # kiln's autodiff
    loss_value, dparams = kiln.jax.value_and_grad(loss, argnums=1)(x, params)
    kiln.jax.jit(jax.grad(loss, argnums=1))(x, params)       # JAX's gradient jaxpr, compiled

How a call runs: the arguments are flattened (``jax.tree_util``); their shapes, dtypes and
weak-type flags, the pytree structure and the static arguments form the signature.  The first
call with a signature traces the function to a jaxpr (``jax.make_jaxpr``), lowers it to a kiln
graph (:func:`kiln.frontends.jax.capture_jaxpr`), runs kiln's passes and builds it with the
backend; later calls with that signature reuse it (``.cache_size`` counts the entries), as
``jax.jit`` does.  Arrays cross without copies where DLPack allows
(:mod:`kiln.frontends.jax.arrays`).

The two gradient routes:

* :func:`grad` / :func:`value_and_grad` capture the *forward* function and differentiate
  the kiln graph with kiln's own autodiff (:func:`kiln.passes.autodiff.grad_graph`, as
  ``kiln.compile_train`` does), so JAX's AD never runs.  ``custom_jvp``/``custom_vjp``
  functions are differentiated through their primal (their custom rules are not used).
* ``jit(jax.grad(f))`` compiles the jaxpr JAX's AD produced, like any other function.

JAX is imported on first use, so ``import kiln`` never needs it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.backends import DEFAULT_BACKEND, get_backend
from kiln.ir import Graph, KilnError
from kiln.passes.autodiff import grad_graph
from kiln.passes.pipeline import resolve_passes

from kiln.frontends.options import CacheSwitch

MODES = ("call", "grad", "value_and_grad")


@dataclass
class _Entry:
    """One compiled signature: the built executable and how its outputs are assembled."""

    executable: Any
    types: list[Any]
    assemble: Callable[[list[Any]], Any]
    graph: Graph
    captured: Graph


class Jitted:
    """A function compiled by kiln per input signature; call it like the function.

    Attributes: ``cache_size`` (compiled signatures), ``graph`` (the kiln graph built for
    the latest signature, after the passes), ``captured_graph`` (as captured, before them).
    """

    def __init__(self, fun: Callable[..., Any], *, mode: str = "call", argnums: int | Sequence[int] = 0,
                 has_aux: bool = False, static_argnums: int | Sequence[int] = (),
                 static_argnames: str | Sequence[str] = (), backend: Any = DEFAULT_BACKEND,
                 passes: Any = "default", outputs: str = "jax", cache: bool = True,
                 cache_dir: str | None = None, options: dict[str, Any] | None = None):
        from kiln.frontends.jax import arrays

        if not callable(fun):
            raise TypeError(f"kiln.jax: expected a function, got {type(fun).__name__}")
        if outputs not in arrays.OUTPUT_KINDS:
            raise ValueError(f"kiln.jax: outputs={outputs!r}; use one of {', '.join(arrays.OUTPUT_KINDS)}")
        self._arrays = arrays
        self.fun = fun
        self.mode = mode
        self.argnums = argnums
        self.has_aux = bool(has_aux)
        self.static_argnums = _as_tuple(static_argnums)
        self.static_argnames = _as_tuple(static_argnames)
        self.outputs = outputs
        self.backend = get_backend(backend)
        self.options = CacheSwitch(bool(cache), cache_dir).for_backend(self.backend, dict(options or {}))
        self.backend.resolve_options(self.options)  # unknown options fail before any tracing
        self.transform = resolve_passes(passes)
        self._cache: dict[Any, _Entry] = {}
        self._latest: _Entry | None = None
        functools.update_wrapper(self, fun)

    @property
    def cache_size(self) -> int:
        return len(self._cache)

    @property
    def graph(self) -> Graph | None:
        return None if self._latest is None else self._latest.graph

    @property
    def captured_graph(self) -> Graph | None:
        return None if self._latest is None else self._latest.captured

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        to_torch, from_torch = self._arrays.to_torch, self._arrays.from_torch
        key, leaves, split = self._signature(args, kwargs)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = self._compile(leaves, *split)
        self._latest = entry
        tensors = [to_torch(x, kind) for x, kind in zip(leaves, entry.types)]
        outputs = entry.executable(tensors)
        return entry.assemble([from_torch(t, self.outputs) for t in outputs])

    # ------------------------------------------------------------------ signature
    def _signature(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, list[Any], tuple]:
        import jax

        leaf_signature = self._arrays.leaf_signature
        static_pos = {i % len(args) if args else i for i in self.static_argnums if -len(args) <= i < len(args)}
        dynamic = tuple(a for i, a in enumerate(args) if i not in static_pos)
        statics = tuple((i, args[i]) for i in sorted(static_pos))
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        static_kwargs = tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
        leaves, tree = jax.tree_util.tree_flatten((dynamic, dyn_kwargs))
        key = (tree, tuple(leaf_signature(x) for x in leaves), statics, static_kwargs)
        try:
            hash(key)
        except TypeError as e:
            raise TypeError(f"kiln.jax: {e}; static arguments must be hashable") from None
        return key, leaves, (tree, statics, static_kwargs, len(args))

    def _call_with(self, *flat: Any, tree: Any, statics: tuple, static_kwargs: tuple,
                   count: int) -> Any:
        """``fun`` on the flat dynamic leaves with the static arguments put back."""
        import jax

        dynamic, kwargs = jax.tree_util.tree_unflatten(tree, list(flat))
        rest = iter(dynamic)
        fixed = dict(statics)
        args = [fixed[i] if i in fixed else next(rest) for i in range(count)]
        return self.fun(*args, **kwargs, **dict(static_kwargs))

    # ------------------------------------------------------------------ compiling
    def _compile(self, leaves: list[Any], tree: Any, statics: tuple, static_kwargs: tuple,
                 count: int) -> _Entry:
        import jax

        from kiln.frontends.jax import capture_jaxpr

        call = functools.partial(self._call_with, tree=tree, statics=statics,
                                 static_kwargs=static_kwargs, count=count)
        aux: dict[str, Any] = {}
        if self.mode != "call":
            call = self._loss_first(call, aux)
        closed, out_shape = jax.make_jaxpr(call, return_shape=True)(*leaves)
        names = [f"x{i}" for i in range(len(leaves))]
        captured = capture_jaxpr(closed, name=_name_of(self.fun), input_names=names)
        if self.mode == "call":
            graph = captured
            assemble = functools.partial(jax.tree_util.tree_unflatten, jax.tree_util.tree_structure(out_shape))
        else:
            wrt = self._wrt_arguments(tree, statics, count)
            graph, assemble = self._gradient_graph(captured, out_shape, wrt, aux.get("tree"))
        optimized = self.transform(graph) if self.transform is not None else graph
        if [v.type for v in optimized.inputs] != [v.type for v in captured.inputs]:
            raise KilnError(f"kiln internal error: the passes changed the inputs of graph @{graph.name}")
        executable = self.backend.build(optimized, self.options)
        return _Entry(executable, [v.type for v in captured.inputs], assemble, optimized, captured)

    def _wrt_arguments(self, tree: Any, statics: tuple, count: int) -> list[tuple[Any, list[int]]]:
        """Per differentiated argument: its pytree structure and the flat positions of its
        leaves."""
        fixed = {i for i, _ in statics}
        dynamic = [i for i in range(count) if i not in fixed]
        children = tree.children()[0].children()
        starts = [sum(c.num_leaves for c in children[:j]) for j in range(len(children))]
        found = []
        for a in _as_tuple(self.argnums):
            if not -count <= a < count:
                raise KilnError(f"kiln.jax.{self.mode}: argnums {a} is out of range for {count} "
                                "positional argument(s)")
            if a % count in fixed:
                raise KilnError(f"kiln.jax.{self.mode}: argument {a} is static and cannot be "
                                "differentiated")
            j = dynamic.index(a % count)
            found.append((children[j], list(range(starts[j], starts[j] + children[j].num_leaves))))
        return found

    def _loss_first(self, call: Callable[..., Any], aux: dict[str, Any]) -> Callable[..., Any]:
        """``call`` returning its loss, then the leaves of its aux value (``has_aux``; their
        structure goes to ``aux["tree"]`` while tracing)."""
        import jax

        def loss_and_aux(*xs: Any) -> tuple[Any, ...]:
            out = call(*xs)
            if not self.has_aux:
                return (out,)
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise KilnError(f"kiln.jax.{self.mode}(has_aux=True): the function must return a "
                                f"pair (loss, aux), got {type(out).__name__}")
            leaves, aux["tree"] = jax.tree_util.tree_flatten(out[1])
            return (out[0], *leaves)
        return loss_and_aux

    def _gradient_graph(self, captured: Graph, out_shape: Any, wrt: list[tuple[Any, list[int]]],
                        aux_tree: Any) -> tuple[Graph, Callable[[list[Any]], Any]]:
        """kiln's joint graph (loss, aux leaves, then one gradient per differentiated leaf),
        and how its outputs become ``grad``'s / ``value_and_grad``'s result."""
        import jax
        import numpy as np

        loss = out_shape[0]
        if tuple(loss.shape) != () or not np.issubdtype(loss.dtype, np.floating):
            raise KilnError(f"kiln.jax.{self.mode}: the function must return a scalar float loss (as "
                            f"for jax.grad), got {loss.dtype}{list(loss.shape)}; reduce it with "
                            ".sum() or .mean(), or return (loss, aux) with has_aux=True")
        flat = [p for _, positions in wrt for p in positions]
        for p in flat:
            kind = captured.inputs[p].type
            if not kind.dtype.is_floating:
                raise KilnError(f"kiln.jax.{self.mode}: cannot differentiate with respect to an input "
                                f"of type {kind} (argnums={self.argnums}); only float inputs have "
                                "gradients, as in jax.grad")
        joint = grad_graph(captured, wrt=[captured.inputs[p].name for p in flat], loss=0)
        aux_count = len(out_shape) - 1
        trees = [t for t, _ in wrt]
        single, mode, has_aux = isinstance(self.argnums, int), self.mode, self.has_aux

        def assemble(outs: list[Any]) -> Any:
            value, grads = outs[0], outs[1 + aux_count:]
            parts, start = [], 0
            for sub in trees:
                parts.append(jax.tree_util.tree_unflatten(sub, grads[start:start + sub.num_leaves]))
                start += sub.num_leaves
            g = parts[0] if single else tuple(parts)
            if not has_aux:
                return g if mode == "grad" else (value, g)
            aux = jax.tree_util.tree_unflatten(aux_tree, outs[1:1 + aux_count])
            return (g, aux) if mode == "grad" else ((value, aux), g)

        return joint.graph, assemble


def _as_tuple(x: Any) -> tuple:
    if x is None:
        return ()
    return (x,) if isinstance(x, (int, str)) else tuple(x)


def _name_of(fun: Any) -> str:
    import re

    name = getattr(fun, "__name__", None) or type(fun).__name__
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def jit(fun: Callable[..., Any] | None = None, *, static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (), donate_argnums: Any = None,
        backend: Any = DEFAULT_BACKEND, passes: Any = "default", outputs: str = "jax",
        cache: bool = True, cache_dir: str | None = None, **options: Any) -> Any:
    """``fun`` compiled by kiln, called like ``jax.jit(fun)`` (see the module docstring).

    Args:
        fun: a function of arrays (pytrees of them) and, where ``static_argnums`` /
            ``static_argnames`` say so, hashable static values.  Used as a decorator
            without arguments too (``@kiln.jax.jit``).
        static_argnums, static_argnames: as for ``jax.jit``: each new static value compiles
            anew.
        donate_argnums: accepted for ``jax.jit`` compatibility; kiln never writes inputs.
        backend: a kiln backend name (``"cpu"``, ``"reference"``...) or instance.
        passes: kiln's pass pipeline, as for :func:`kiln.compile` (``None``: none).
        outputs: ``"jax"`` (``jax.Array``s, zero-copy through DLPack) or ``"numpy"``.
        cache, cache_dir: kiln's compile cache, as for :func:`kiln.compile`.
        **options: options of the backend.
    """
    del donate_argnums
    if fun is None:
        return functools.partial(jit, static_argnums=static_argnums, static_argnames=static_argnames,
                                 backend=backend, passes=passes, outputs=outputs, cache=cache,
                                 cache_dir=cache_dir, **options)
    return Jitted(fun, static_argnums=static_argnums, static_argnames=static_argnames, backend=backend,
                  passes=passes, outputs=outputs, cache=cache, cache_dir=cache_dir, options=options)


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False, *,
                   static_argnums: int | Sequence[int] = (), backend: Any = DEFAULT_BACKEND,
                   passes: Any = "default", outputs: str = "jax", cache: bool = True,
                   cache_dir: str | None = None, **options: Any) -> Jitted:
    """``(fun(*args), d fun / d args[argnums])``, compiled; the gradient is kiln's autodiff
    on the captured forward graph.  ``argnums`` and ``has_aux`` as for
    ``jax.value_and_grad``; the other arguments as for :func:`jit`."""
    return Jitted(fun, mode="value_and_grad", argnums=argnums, has_aux=has_aux,
                  static_argnums=static_argnums, backend=backend, passes=passes, outputs=outputs,
                  cache=cache, cache_dir=cache_dir, options=options)


def grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False, *,
         static_argnums: int | Sequence[int] = (), backend: Any = DEFAULT_BACKEND,
         passes: Any = "default", outputs: str = "jax", cache: bool = True,
         cache_dir: str | None = None, **options: Any) -> Jitted:
    """The gradient of scalar ``fun`` with respect to ``args[argnums]``, compiled, by
    kiln's autodiff; arguments as for :func:`value_and_grad`."""
    return Jitted(fun, mode="grad", argnums=argnums, has_aux=has_aux, static_argnums=static_argnums,
                  backend=backend, passes=passes, outputs=outputs, cache=cache, cache_dir=cache_dir,
                  options=options)


__all__ = ["Jitted", "grad", "jit", "value_and_grad"]
