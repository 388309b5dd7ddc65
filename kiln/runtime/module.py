"""The compiled module: checks inputs, runs a backend's executable, restores output structure.

Guarantees of :class:`CompiledModule`:

* Inputs are flattened with the pytree spec of the example inputs and checked *before*
  anything runs: argument structure and keyword names, tensor-ness, dtype, rank and shape
  against the graph's input types, and equality of non-tensor inputs (kiln specializes
  them at compile time).  A symbolic input shape (``f32[batch, 3]``) binds its named sizes
  from the actual shapes and checks each against its range (``CompiledModule.sizes``, the
  graph's ``sizes``): a size out of range, or inputs that disagree on a size, raise
  :class:`~kiln.ir.sizes.SizeError` naming the input, the axis, the range and the value.  A mismatch raises :class:`InputMismatchError` saying which input,
  what was expected, what was given and how to go on.
* Parameters are referenced, not copied: the module holds the model's live tensors and reads
  them at every call, so in-place updates of the weights are seen.  (Rebinding a module
  attribute to a new tensor object is not; recompile then.)
* Outputs are torch tensors, unflattened with the output spec, so tuples, dicts and
  Hugging Face ``ModelOutput`` objects come back as in eager mode.  When grad mode is on and
  an input or parameter requires grad, the module runs kiln's forward graph inside a
  ``torch.autograd.Function`` whose backward is kiln's generated backward graph
  (:mod:`kiln.frontends.torch.autograd`); otherwise it runs the inference graph.
* Buffers a train-mode model updates (batch norm's ``running_mean``/``running_var``/
  ``num_batches_tracked``) are written in place into the live buffers after every call, as
  eager does: the captured graph returns their new values as trailing outputs named
  ``buffer_update.<param>`` (:func:`buffer_updates`), which are not returned to the caller.
* Random ops read the ``int64[]`` param ``rng.seed``; the module refills it from torch's
  default generator before every call (:func:`draw_seed`), so each call draws new dropout
  masks and ``torch.manual_seed`` makes a run reproducible.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from kiln.ir import Graph, KilnError, TensorType
from kiln.ir.sizes import SizeError, bind_sizes
from kiln.ir.types import SizeRange

from .tensors import describe, kiln_dtype, torch_dtype

_HOW_TO_GO_ON = "recompile with new example_inputs or pass a matching tensor"

BUFFER_UPDATE_PREFIX = "buffer_update."
"""Name prefix of a graph output holding the new value of the buffer param it names."""

INPUT_UPDATE_PREFIX = "input_update."
"""Name prefix of a graph output holding the new value of the graph input it names (a
program that writes one of its inputs in place, such as ``x.uniform_()``)."""

RNG_SEED_PARAM = "rng.seed"
"""The seed param of random ops (the same name as :data:`kiln.ir.ops.random.RNG_SEED_PARAM`)."""

_SEED_RANGE = 2**31 - 1


def buffer_updates(graph: Graph) -> list[tuple[int, str]]:
    """``(output index, param name)`` of each output of ``graph`` that updates a buffer."""
    return [(i, v.name[len(BUFFER_UPDATE_PREFIX):]) for i, v in enumerate(graph.outputs)
            if v.name.startswith(BUFFER_UPDATE_PREFIX)]


def input_updates(graph: Graph) -> list[tuple[int, str]]:
    """``(output index, input name)`` of each output of ``graph`` that updates an input."""
    return [(i, v.name[len(INPUT_UPDATE_PREFIX):]) for i, v in enumerate(graph.outputs)
            if v.name.startswith(INPUT_UPDATE_PREFIX)]


def draw_seed() -> int:
    """A seed for the random ops of one call, drawn from torch's default generator."""
    return int(torch.randint(0, _SEED_RANGE, (1,), dtype=torch.int64).item())


class StateBinding:
    """The buffers a graph updates and the seeds it reads, bound to live tensors.

    ``params`` are the tensors of ``graph.params`` in order.  :meth:`before` refills the
    seeds; :meth:`after` copies the trailing buffer-update outputs into their buffers (in
    place, outside autograd) and returns the other outputs.
    """

    def __init__(self, graph: Graph, params: Sequence[torch.Tensor]):
        position = {v.name: i for i, v in enumerate(graph.params)}
        self.updates = [(index, params[position[name]]) for index, name in buffer_updates(graph)
                        if name in position]
        self.seeds = [params[i] for i, v in enumerate(graph.params) if v.name == RNG_SEED_PARAM]
        inputs = {v.name: i for i, v in enumerate(graph.inputs)}
        self.input_updates = [(index, inputs[name]) for index, name in input_updates(graph) if name in inputs]
        self.num_outputs = len(graph.outputs) - len(self.updates) - len(self.input_updates)
        if any(index < self.num_outputs for index, _ in (*self.updates, *self.input_updates)):
            raise KilnError(f"kiln internal error: graph @{graph.name} has buffer or input updates "
                            "before its last user output")

    def __bool__(self) -> bool:
        return bool(self.updates or self.seeds or self.input_updates)

    def before(self) -> None:
        for seed in self.seeds:
            seed.fill_(draw_seed())

    def after(self, outputs: Sequence[torch.Tensor],
              inputs: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """Write the buffer updates, and the input updates into ``inputs`` (the call's graph
        inputs), in place; return the user outputs."""
        if not (self.updates or self.input_updates):
            return list(outputs)
        self.write_updates(outputs)
        with torch.no_grad():
            for index, position in self.input_updates:
                inputs[position].copy_(outputs[index])
        return list(outputs[: self.num_outputs])

    def write_updates(self, outputs: Sequence[torch.Tensor],
                      index_map: dict[int, int] | None = None) -> None:
        """Copy the buffer updates among ``outputs`` into their buffers (in place, outside
        autograd).  ``index_map`` maps an output index of the bound graph to its index in
        ``outputs``, for the outputs of a graph built from it (a training step keeps the
        forward's outputs, at other places)."""
        with torch.no_grad():
            for index, buffer in self.updates:
                buffer.copy_(outputs[index if index_map is None else index_map[index]])


class InputMismatchError(KilnError, TypeError):
    """Inputs given to a compiled module do not match the ones it was compiled for."""


@dataclass(frozen=True)
class InputSlot:
    """One leaf of the flattened ``(args, kwargs)``.

    ``type`` is the expected tensor type of a graph input; for a non-tensor input that was
    specialized at compile time it is ``None`` and ``value`` holds the example value.
    """

    name: str
    type: TensorType | None
    value: Any = None

    @property
    def is_tensor(self) -> bool:
        return self.type is not None


Executable = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


class CompiledModule:
    """A model compiled by kiln; call it like the original model. See the module docstring.

    Attributes: ``graph`` (the kiln IR), ``graphs`` (all kiln graphs, one per partition when
    some ops fall back to PyTorch), ``backend`` (its name), ``stats`` (counters and timings),
    ``sources`` (the generated kernels' sources, where the backend exposes them).
    """

    def __init__(self, executable: Executable, *, inputs: Sequence[InputSlot],
                 params: Sequence[torch.Tensor], in_spec: pytree.TreeSpec | None,
                 out_spec: pytree.TreeSpec | None, graphs: Sequence[Graph], backend: str,
                 name: str = "main", info: dict[str, Any] | None = None,
                 sizes: Mapping[str, SizeRange] | None = None):
        self.executable = executable
        self.inputs = tuple(inputs)
        self.sizes: dict[str, SizeRange] = dict(sizes) if sizes is not None else _graph_ranges(graphs)
        """The range of every named size of the inputs' symbolic shapes, checked each call."""
        self._symbolic = [i for i, s in enumerate(self.inputs) if s.is_tensor and not s.type.is_static]
        self.params = list(params)
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.graphs = list(graphs)
        self.backend = backend
        self.name = name
        self._info = dict(info or {})
        self._calls = 0
        self._total_s = 0.0
        self._last_s = 0.0
        self._kwarg_names = _kwarg_names(in_spec)
        self._leaf_args = _leaf_arg_count(in_spec)
        self._out_form = _output_form(out_spec)
        self._expected = [_fast_signature(s) for s in self.inputs]
        self.state: StateBinding | None = None
        if len(self.graphs) == 1:
            self.bind_state(self.graphs[0])

    def bind_state(self, graph: Graph) -> None:
        """Read buffer updates and seeds from ``graph`` (the module's graph, or the captured
        graph it was optimized from: same params and outputs)."""
        state = StateBinding(graph, self.params)
        self.state = state if state else None

    # ------------------------------------------------------------------ calling
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self._check(self._flatten(args, kwargs)))

    def _run(self, tensors: list[torch.Tensor]) -> Any:
        """Run the executable on checked input tensors (no autograd) and structure the outputs."""
        start = time.perf_counter()
        if self.state is not None:
            self.state.before()
        if torch.is_grad_enabled():
            with torch.no_grad():
                outputs = self.executable([*tensors, *self.params])
        else:
            outputs = self.executable([*tensors, *self.params])
        if self.state is not None:
            outputs = self.state.after(outputs, tensors)
        self._last_s = time.perf_counter() - start
        self._total_s += self._last_s
        self._calls += 1
        return self._structured(outputs)

    def _structured(self, outputs: Sequence[torch.Tensor]) -> Any:
        if self._out_form == "leaf":
            return outputs[0]
        if self._out_form == "tuple":
            return tuple(outputs)
        if self.out_spec is None:
            return outputs[0] if len(outputs) == 1 else tuple(outputs)
        return pytree.tree_unflatten(list(outputs), self.out_spec)

    def _flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        if not kwargs and len(args) == self._leaf_args and all(type(a) is torch.Tensor for a in args):
            return list(args)  # fast path: tensors exactly where the spec has leaves, no pytree walk
        if self.in_spec is None:
            if kwargs:
                raise InputMismatchError(
                    f"kiln: {self.name} takes no keyword arguments, got {sorted(kwargs)}")
            return self._check_count(list(args))
        missing = [k for k in self._kwarg_names if k not in kwargs]
        unexpected = sorted(set(kwargs) - set(self._kwarg_names))
        if missing or unexpected:
            raise InputMismatchError(
                f"kiln: {self.name} was compiled with keyword arguments {list(self._kwarg_names)} "
                f"but is called with {sorted(kwargs)} (missing {missing}, unexpected {unexpected}); "
                "recompile with matching example_kwargs"
            )
        ordered = {k: kwargs[k] for k in self._kwarg_names}
        flat, spec = pytree.tree_flatten((tuple(args), ordered))
        if spec != self.in_spec:
            self._structure_error(args, spec)
        return flat

    def _check_count(self, flat: list[Any]) -> list[Any]:
        if len(flat) != len(self.inputs):
            names = ", ".join(s.name for s in self.inputs)
            raise InputMismatchError(
                f"kiln: {self.name} expects {len(self.inputs)} input(s) ({names}) but got "
                f"{len(flat)}; {_HOW_TO_GO_ON}"
            )
        return flat

    def _structure_error(self, args: tuple[Any, ...], spec: pytree.TreeSpec) -> None:
        expected_args, expected_kwargs = self.in_spec.children()
        if len(args) != expected_args.num_children:
            names = ", ".join(s.name for s in self.inputs[: expected_args.num_leaves])
            raise InputMismatchError(
                f"kiln: {self.name} expects {expected_args.num_children} positional input(s) "
                f"({names}) but got {len(args)}; {_HOW_TO_GO_ON}"
            )
        given = spec.children()[0].children() + spec.children()[1].children()
        leaf = 0
        for expected, got in zip(expected_args.children() + expected_kwargs.children(), given):
            if expected != got:
                slot = self.inputs[leaf] if leaf < len(self.inputs) else None
                if expected.is_leaf() and slot is not None and slot.is_tensor:
                    raise InputMismatchError(
                        f"kiln: input {leaf} ('{slot.name}') expects {slot.type} but got a nest "
                        f"structured as {pytree.treespec_pprint(got)}; {_HOW_TO_GO_ON}")
                raise InputMismatchError(
                    f"kiln: the argument holding input {leaf} is structured as "
                    f"{pytree.treespec_pprint(got)} but was compiled as "
                    f"{pytree.treespec_pprint(expected)}; {_HOW_TO_GO_ON}")
            leaf += expected.num_leaves
        raise InputMismatchError(
            f"kiln: {self.name} was compiled for inputs structured as "
            f"{pytree.treespec_pprint(self.in_spec)} but got {pytree.treespec_pprint(spec)}; "
            f"{_HOW_TO_GO_ON}"
        )

    def _check(self, flat: list[Any]) -> list[torch.Tensor]:
        self._check_count(flat)
        tensors: list[torch.Tensor] = []
        for index, (slot, value, expected) in enumerate(zip(self.inputs, flat, self._expected)):
            if expected is not None and isinstance(value, torch.Tensor) and value.dtype is expected[0] \
                    and value.shape == expected[1]:
                tensors.append(value)  # the common case: exactly the compiled dtype and static shape
            elif slot.is_tensor:
                _check_tensor(index, slot, value)
                tensors.append(value)
            elif not _same_constant(slot.value, value):
                raise InputMismatchError(
                    f"kiln: input {index} ('{slot.name}') was {slot.value!r} at compile time and "
                    f"kiln specializes non-tensor inputs, but got {value!r}; recompile with new "
                    "example_inputs"
                )
        if self._symbolic:
            self.bind_sizes(flat)
        return tensors

    def bind_sizes(self, flat: Sequence[Any]) -> dict[str, int]:
        """The value of every named size at this call, from the flattened inputs' shapes,
        checked against :attr:`sizes`: a size out of its range, or shapes that disagree on a
        size, raise :class:`~kiln.ir.sizes.SizeError` (naming the input and axis, the range
        and the value) before anything runs."""
        slots = [self.inputs[i] for i in self._symbolic]
        shapes = [tuple(flat[i].shape) for i in self._symbolic]
        try:
            return bind_sizes([s.type for s in slots], shapes,
                              [f"input {i} ('{s.name}')" for i, s in zip(self._symbolic, slots)], self.sizes)
        except SizeError as e:
            where = _where_read(str(e), self._symbolic, slots, shapes)
            raise SizeError(f"kiln: {self.name}: {e}{where}") from None

    # ------------------------------------------------------------- inspection
    @property
    def graph(self) -> Graph:
        """The kiln graph; when ops fell back to PyTorch there are several: see ``graphs``."""
        if len(self.graphs) == 1:
            return self.graphs[0]
        if not self.graphs:
            raise KilnError(f"kiln: {self.name} runs entirely in PyTorch; it has no kiln graph")
        raise KilnError(
            f"kiln: {self.name} was split into {len(self.graphs)} kiln graphs around ops that run in "
            "PyTorch; use .graphs for the list"
        )

    @property
    def sources(self) -> dict[str, str]:
        """Kernel name -> source text of each generated kernel, for backends whose executables
        expose them (``cuda``: every GPU kernel's CUDA C); ``{}`` otherwise, and for modules
        split around ops that run in PyTorch."""
        return dict(getattr(self.executable, "sources", None) or {})

    @property
    def stats(self) -> dict[str, Any]:
        """Counters: graphs, nodes, op histogram, fallback ops, calls and run times (seconds)."""
        histogram: dict[str, int] = {}
        for g in self.graphs:
            for op, count in g.op_histogram().items():
                histogram[op] = histogram.get(op, 0) + count
        return {
            "backend": self.backend,
            "graphs": len(self.graphs),
            "nodes": sum(len(g.nodes) for g in self.graphs),
            "ops": dict(sorted(histogram.items())),
            "params": len(self.params),
            **self._info,
            "calls": self._calls,
            "total_run_s": self._total_s,
            "last_run_s": self._last_s,
        }

    def __repr__(self) -> str:
        nodes = sum(len(g.nodes) for g in self.graphs)
        return (f"<CompiledModule {self.name!r} backend={self.backend}: {len(self.graphs)} graph(s), "
                f"{nodes} nodes, {len(self.params)} params>")


def _kwarg_names(in_spec: pytree.TreeSpec | None) -> tuple[str, ...]:
    """Keyword names of an ``(args, kwargs)`` spec, in the order they were flattened."""
    if in_spec is None or in_spec.type is not tuple or in_spec.num_children != 2:
        return ()
    kwargs_spec = in_spec.children()[1]
    return tuple(kwargs_spec.context or ())


def _leaf_arg_count(in_spec: pytree.TreeSpec | None) -> int:
    """How many positional arguments when the spec is ``(leaf, ..., leaf), {}``, else -1."""
    if in_spec is None or in_spec.type is not tuple or in_spec.num_children != 2:
        return -1
    args_spec, kwargs_spec = in_spec.children()
    if kwargs_spec.num_children or any(not child.is_leaf() for child in args_spec.children()):
        return -1
    return args_spec.num_children


def _output_form(out_spec: pytree.TreeSpec | None) -> str | None:
    """``"leaf"`` (one tensor) or ``"tuple"`` (a flat tuple of tensors) when the outputs need
    no pytree walk to be structured, else ``None``."""
    if out_spec is None:
        return None
    if out_spec.is_leaf():
        return "leaf"
    if out_spec.type is tuple and all(child.is_leaf() for child in out_spec.children()):
        return "tuple"
    return None


def _fast_signature(slot: InputSlot) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """The torch dtype and static shape a tensor input must have, for the per-call check's fast
    path (``None``: a non-tensor, a symbolic shape or a dtype torch lacks: the full check)."""
    if slot.type is None or not slot.type.is_static:
        return None
    try:
        return torch_dtype(slot.type.dtype), tuple(slot.type.shape)
    except (TypeError, KeyError, ValueError):
        return None


def _check_tensor(index: int, slot: InputSlot, value: Any) -> None:
    expected = slot.type
    assert expected is not None
    ok = isinstance(value, torch.Tensor) and value.dim() == expected.rank
    if ok:
        try:
            ok = kiln_dtype(value.dtype) == expected.dtype
        except TypeError:
            ok = False
    if ok:
        # symbolic dimensions match any size
        ok = all(not isinstance(want, int) or want == got
                 for want, got in zip(expected.shape, value.shape))
    if not ok:
        raise InputMismatchError(
            f"kiln: input {index} ('{slot.name}') expects {expected} but got {describe(value)}; "
            f"{_HOW_TO_GO_ON}"
        )


def _where_read(message: str, positions: Sequence[int], slots: Sequence[InputSlot],
                shapes: Sequence[tuple[int, ...]]) -> str:
    """`` (from input 0 ('x') axis 0 of shape [65, 3], type f32[batch, 3])`` for the size a
    range error names; empty when the message names no size."""
    for i, slot, shape in zip(positions, slots, shapes):
        for axis, d in enumerate(slot.type.shape):
            if not isinstance(d, int) and d.is_symbol and message.startswith(f"size {d} = "):
                return f" (read from input {i} ('{slot.name}') axis {axis} of shape {list(shape)}, type {slot.type})"
    return ""


def _graph_ranges(graphs: Sequence[Graph]) -> dict[str, SizeRange]:
    ranges: dict[str, SizeRange] = {}
    for g in graphs:
        ranges.update(getattr(g, "sizes", None) or {})
    return ranges


def _same_constant(expected: Any, got: Any) -> bool:
    if type(expected) is not type(got):
        return False
    try:
        return bool(expected == got)
    except Exception:  # noqa: BLE001 - objects whose == is not a plain bool are never equal here
        return expected is got
