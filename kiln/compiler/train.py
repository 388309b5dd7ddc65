"""``kiln.compile_train``: a whole training step -- forward, backward, optimizer -- as one graph.

::

    step = kiln.compile_train(model, loss_fn, optimizer, (x, y))
    for x, y in data:
        loss = step(x, y)          # updates model's params and optimizer.state in place

How it is built: the model and the loss are exported together (a wrapper module computing
``loss_fn(model(*inputs), *targets)``), captured into one kiln graph, optionally rewritten
by the ``amp`` pass, differentiated by :func:`kiln.passes.autodiff.grad_graph`, and the
optimizer's update is appended in IR (:func:`kiln.passes.optim.append_optimizer`).  The
``passes`` (by default kiln's default pipeline, fusion included) then see the whole step,
update included; with ``remat=True`` the ``remat`` pass
(:func:`kiln.passes.remat.rematerialize`) runs after them (with the default pipeline: before
its fusion), and the backend builds the result.

Guarantees of the returned :class:`TrainStep`:

* ``step(*inputs, *targets)`` returns the loss (a float32 0-d tensor) and updates, in place,
  every parameter of the optimizer that the loss depends on, and its optimizer state, kept in
  ``optimizer.state`` in PyTorch's own format (``momentum_buffer``;
  ``step``/``exp_avg``/``exp_avg_sq``): the tensor objects stay the same.  Where the backend
  writes outputs into given tensors (the compiled backends) and no other tensor shares a
  parameter's or state's storage (no view, ``.data``, ``.detach()`` or tie kept alive
  elsewhere), the step writes the new values into a second buffer and swaps the storages
  (``set_``): no copy, and the storage alternates between two buffers, so ``data_ptr()``
  changes from step to step.  Otherwise the new values are copied in (``copy_``), and views
  follow them as in eager.  Eager ``optimizer.step()`` calls can be mixed with
  kiln steps: both continue the same trajectory.  Parameters the loss does not depend on are
  left alone, as PyTorch leaves params whose ``.grad`` is ``None``.  ``.grad`` is not set.
* Hyperparameters (``lr``, ``momentum``, ``dampening``, ``weight_decay``, ``betas``,
  ``eps``) are read from ``optimizer.param_groups`` at every call, so schedulers work
  without recompiling.  Changing a structural flag (``nesterov``, ``maximize``, momentum
  becoming zero or non-zero) rebuilds the update part only.
* Supported optimizers: ``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay,
  maximize), ``torch.optim.AdamW`` and ``torch.optim.Adam`` (amsgrad, maximize); several
  param groups with their own hyperparameters.  Any other optimizer raises
  :class:`~kiln.ir.KilnError` naming it and the supported ones.
* ``amp="bfloat16"``/``"float16"`` computes matmuls and convs in low precision with float32
  master weights (see :mod:`kiln.passes.amp`).  float16 adds dynamic loss scaling: a step
  whose gradients overflow is skipped (params and state unchanged) and halves the scale;
  ``step.loss_scale`` and ``step.scaler`` expose it.
* ``remat=True`` recomputes cheap forward values (elementwise, view, copy ops; a minimum
  cut as in ``split_joint(policy="remat")``) in the backward instead of keeping them alive
  from the forward, so the backend's liveness-based memory plan reuses their buffers; same
  losses and updates as the default ``remat=False``.  ``step.stats`` reports
  ``recomputed_nodes`` and, when the backend plans memory (``cpu``), ``planned_peak_bytes``
  (the arena) and ``planned_total_bytes`` (all intermediates).
* Train-mode batch norm: the captured step returns the loss, then the new buffer values
  (``buffer_update.<buffer>``), which are not differentiated and are ``copy_``d into the
  live buffers after every step (running mean/var, ``num_batches_tracked``), as eager.
  Dropout: the seed param ``rng.seed`` is refilled from torch's generator before every step
  (:class:`kiln.runtime.module.StateBinding`), so each step draws new masks, reproducible
  under ``torch.manual_seed``; the backward (and ``remat``'s recomputation) uses the
  forward's mask.
* Inputs are checked against the example inputs (shapes, dtypes) before anything runs.
* Auxiliary outputs: a ``loss_fn`` returning a tuple ``(loss, *aux)`` makes the step return
  ``(loss, *aux)``; only ``loss`` is differentiated, the ``aux`` tensors (per-sample losses
  and confidences, for :func:`kiln.train.hide_samples`) are computed by the same forward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.backends import DEFAULT_BACKEND, Backend, get_backend
from kiln.ir import DType, Graph, KilnError, TensorType
from kiln.passes.amp import (
    AutoMixedPrecision,
    LossScaler,
    low_dtype,
    scale_loss,
    unscale_gradients,
)
from kiln.passes.autodiff import grad_graph
from kiln.passes.optim import GroupSpec, UpdateLayout, append_optimizer
from kiln.passes.remat import rematerialize
from kiln.ir.sizes import SizeError, bind_sizes, is_dynamic
from kiln.runtime import InputMismatchError, tensor_type
from kiln.runtime.tensors import sole_owner
from kiln.runtime.module import StateBinding, buffer_updates

from kiln.frontends.options import CacheSwitch
from kiln.frontends.torch import capture as capture_mod
from .api import as_args, resolve_passes
from .train_graph import check_loss, count_targets, merge_tied_params, params_reaching_loss, readable_names

SUPPORTED_OPTIMIZERS = ("torch.optim.SGD", "torch.optim.Adam", "torch.optim.AdamW")


class _LossModule(torch.nn.Module):
    """``loss_fn(model(*inputs), *targets)`` as one module, so both are exported together."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], num_inputs: int):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn  # a loss module becomes a submodule, a function an attribute
        self.num_inputs = num_inputs

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        output = self.model(*args[: self.num_inputs])
        return self.loss_fn(output, *args[self.num_inputs:])


def compile_train(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor],
                  optimizer: torch.optim.Optimizer, example_inputs: Any, *,
                  num_targets: int | None = None, amp: str | None = None,
                  scaler: LossScaler | None = None, backend: str | Backend = DEFAULT_BACKEND,
                  passes: Any = "default", remat: bool = False, cache: bool = True,
                  cache_dir: str | None = None, dynamic_shapes: Any = None, **options: Any) -> TrainStep:
    """Compile one training step of ``model`` (see the module docstring).

    Args:
        model: the model; its parameters are updated in place.
        loss_fn: ``loss_fn(model_output, *targets)`` returning a scalar tensor.
        optimizer: a ``torch.optim.SGD``, ``Adam`` or ``AdamW`` over the model's parameters.
        example_inputs: the model's positional inputs followed by the targets.
        num_targets: how many trailing example inputs are targets; by default the number of
            required positional parameters of ``loss_fn`` after the model output.
        amp: ``None``, ``"bfloat16"`` or ``"float16"`` (dynamic loss scaling).
        scaler: the :class:`~kiln.passes.amp.LossScaler` for float16 (default:
            ``torch.amp.GradScaler``'s defaults); given with another ``amp`` (or none) it
            turns loss scaling on there too.
        backend, passes, cache, cache_dir, **options: as for :func:`kiln.compile`
            (``"default"``: the default pipeline, fusion included, over the whole step;
            a training step has no capture cache, so ``cache`` and ``cache_dir`` reach the
            backend's compile cache only, where the backend has one).
        dynamic_shapes: torch.export's argument for the step's positional arguments (model
            inputs then targets), e.g. ``({1: Dim("seq", max=512)}, {1: Dim("seq", max=512)})``:
            the step is built once, symbolic in those sizes, and runs at any size in range
            (see ``docs/dynamic.md``).
        remat: recompute cheap forward values in the backward so the memory plan can reuse
            their buffers; same results, lower planned peak.  It runs after ``passes``; with
            the default pipeline, between its clean-ups and its fusion, so the recomputations
            fuse into the backward kernels that read them.
    """
    kind = _optimizer_kind(optimizer)
    args = as_args(example_inputs)
    targets = count_targets(loss_fn) if num_targets is None else num_targets
    if not 0 <= targets <= len(args):
        raise KilnError(f"kiln.compile_train: num_targets={targets} but example_inputs has "
                        f"{len(args)} entries (model inputs followed by targets)")
    low = low_dtype(amp) if amp is not None else None
    backend_impl = get_backend(backend)
    options = CacheSwitch(bool(cache), cache_dir).for_backend(backend_impl, options)
    backend_impl.resolve_options(options)  # unknown options fail before the slow export
    wrapper = _LossModule(model, loss_fn, len(args) - targets)
    if dynamic_shapes is not None:
        if not isinstance(dynamic_shapes, (tuple, list)) or len(dynamic_shapes) != len(args):
            raise KilnError(f"kiln.compile_train: dynamic_shapes must be a tuple with one entry per positional "
                            f"argument (model inputs then targets; {len(args)} here), each None or "
                            "torch.export's per-tensor spec such as {1: Dim('seq')}")
        dynamic_shapes = (tuple(dynamic_shapes),)  # the wrapper takes them as one *args
    captured = capture_mod.capture_program(capture_mod.export_program(wrapper, args, dynamic_shapes=dynamic_shapes),
                                           name=type(model).__name__ + "_train")
    graph, live = readable_names(captured.graph, captured.params, captured.input_positions,
                                  len(args) - targets)
    graph, live = merge_tied_params(graph, live)
    aux = check_loss(graph)
    if low is not None:
        graph = AutoMixedPrecision(low.short).run(graph).graph
    if scaler is None and low == DType.float16:
        scaler = LossScaler()
    return TrainStep(graph, live, captured.input_positions, args, optimizer, kind, scaler,
                     backend_impl, options, *_step_transforms(passes, bool(remat)), remat=bool(remat),
                     aux_outputs=aux)


def _step_transforms(passes: Any, remat: bool) -> tuple[Any, Any]:
    """The transforms before and after the ``remat`` pass: the default pipeline is split
    before its fusion (fused kernels would hide the cheap values remat recomputes)."""
    if remat and isinstance(passes, str) and passes == "default":
        from kiln.passes import default_pipeline

        return resolve_passes(default_pipeline(fuse=False)), resolve_passes("fuse")
    return resolve_passes(passes), None


class TrainStep:
    """A compiled training step; call it with the model inputs and the targets.

    Attributes: ``graph`` (the whole step as one kiln graph, update included), ``layout``
    (where the optimizer's inputs and outputs are, :class:`kiln.passes.optim.UpdateLayout`),
    ``scaler`` (the float16 :class:`~kiln.passes.amp.LossScaler`, else ``None``),
    ``loss_scale``, ``stats``, ``remat`` (whether the ``remat`` pass runs) and
    ``recomputed_nodes`` (how many clones it inserted in the current step graph).
    """

    def __init__(self, forward: Graph, live: dict[str, torch.Tensor], input_positions: Sequence[int],
                 example_args: tuple[Any, ...], optimizer: torch.optim.Optimizer, kind: str,
                 scaler: LossScaler | None, backend: Backend, options: dict[str, Any],
                 transform: Callable[[Graph], Graph] | None, after_remat: Callable[[Graph], Graph] | None = None,
                 *, remat: bool = False, aux_outputs: int = 0):
        self.forward_graph = forward
        self.live = live
        self.optimizer = optimizer
        self.optimizer_name = kind
        self.scaler = scaler
        self.backend = backend
        self.options = options
        self.transform = transform
        self.after_remat = after_remat
        self.remat = remat
        self.aux_outputs = aux_outputs
        """How many auxiliary outputs ``loss_fn`` returns after the loss (see the module docstring)."""
        self.recomputed_nodes = 0
        self._positions = list(input_positions)
        self._example = example_args
        self._name_of = {id(t): name for name, t in live.items()}
        self._trainable = params_reaching_loss(forward)
        state = StateBinding(forward, [live[v.name] for v in forward.params])
        if len(state.updates) != len(buffer_updates(forward)):
            raise KilnError(f"kiln internal error: buffer updates {buffer_updates(forward)} of the "
                            f"training graph @{forward.name} do not all name a param")
        self.state: StateBinding | None = state if state else None
        """The buffers the step updates (train-mode batch norm) and the dropout seed it reads."""
        self._key: tuple | None = None
        self.graph: Graph | None = None
        self.layout: UpdateLayout | None = None
        self._executable: Any = None
        self._plan: list[tuple[str, Any]] = []
        self._skip_output: int | None = None
        self._spare: dict[int, torch.Tensor] = {}
        """Output index -> the buffer the next step writes that output into (see _store)."""
        self._writes_into = False
        self._calls = 0
        self.builds = 0
        """How many times the step graph was built (1, plus one per structural change)."""
        self.skipped_steps = 0
        self._update_structure()

    # ------------------------------------------------------------------ calling
    @property
    def loss_scale(self) -> float | None:
        """The current float16 loss scale (``None`` without loss scaling)."""
        return self.scaler.scale if self.scaler is not None else None

    def __call__(self, *args: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
        tensors = self._check_inputs(args)
        self._update_structure()
        feeds = [self._feed(entry, tensors) for entry in self._plan]
        params = [self.live[v.name] for v in self.graph.params]
        if self.state is not None:
            self.state.before()  # a new dropout seed per step, from torch's generator
        with torch.no_grad():
            if self._spare:
                outputs = self._executable([*feeds, *params], out=self._spare)
            else:
                outputs = self._executable([*feeds, *params])
        self._calls += 1
        if self.state is not None:
            # the forward ran, so the running statistics move even on a skipped step (as
            # eager's forward updates them before GradScaler skips optimizer.step())
            self.state.write_updates(outputs, self.layout.kept)
        found_inf = bool(outputs[self._skip_output]) if self._skip_output is not None else False
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            self.skipped_steps += 1
        else:
            self._write_back(outputs)
            # what torch's wrapper of optimizer.step() records, so LR schedulers do not warn
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
        if self.aux_outputs:
            return tuple(outputs[self.layout.kept[i]] for i in range(1 + self.aux_outputs))
        return outputs[self.layout.kept[0]]

    def _check_inputs(self, args: tuple[Any, ...]) -> list[torch.Tensor]:
        if len(args) != len(self._example):
            raise InputMismatchError(
                f"kiln: the training step takes {len(self._example)} arguments (model inputs "
                f"then targets) but got {len(args)}")
        tensors = []
        for position, input_value in zip(self._positions, self.forward_graph.inputs):
            value = args[position]
            want = input_value.type
            got_type = _type_of(value) if isinstance(value, torch.Tensor) else None
            if got_type is None or not _fits(got_type, want):
                got = f"{value.dtype} tensor of shape {tuple(value.shape)}" \
                    if isinstance(value, torch.Tensor) else type(value).__name__
                raise InputMismatchError(
                    f"kiln: training step argument {position} ('{input_value.name}') expects "
                    f"{want} but got {got}; compile a new step for new shapes")
            tensors.append(value)
        for position, example in enumerate(self._example):
            if position not in self._positions and not _same_constant(example, args[position]):
                raise InputMismatchError(
                    f"kiln: training step argument {position} was {example!r} at compile time and "
                    f"kiln specializes non-tensor arguments, but got {args[position]!r}")
        if is_dynamic(self.forward_graph):
            inputs = self.forward_graph.inputs
            try:
                bind_sizes([v.type for v in inputs], [tuple(t.shape) for t in tensors],
                           [f"training step argument {p} ('{v.name}')" for p, v in zip(self._positions, inputs)],
                           self.forward_graph.sizes)
            except SizeError as e:
                raise InputMismatchError(f"kiln: {e}") from e
        return tensors

    # ------------------------------------------------------------- building
    def _update_structure(self) -> None:
        """(Re)build the step graph when the optimizer's structure changed (or at first)."""
        groups = self._group_specs()
        key = tuple(groups)
        if key != self._key:
            self._build(groups)
            self._key = key

    def _group_specs(self) -> list[GroupSpec]:
        specs = []
        for group in self.optimizer.param_groups:
            names = []
            for p in group["params"]:
                name = self._name_of.get(id(p))
                if name is not None and name in self._trainable and p.requires_grad:
                    names.append(name)
            specs.append(_group_spec(self.optimizer_name, group, tuple(names)))
        return specs

    def _build(self, groups: list[GroupSpec]) -> None:
        graph = self.forward_graph
        loss_index = 0
        scale_name = None
        if self.scaler is not None:
            graph, loss_index = scale_loss(graph, 0)
            scale_name = graph.inputs[-1].name
        wrt = [name for g in groups for name in g.params]
        joint = grad_graph(graph, wrt=wrt, loss=loss_index)
        step_graph, grads = joint.graph, dict(joint.grad_outputs)
        skip = None
        if scale_name is not None:
            step_graph, skip = unscale_gradients(step_graph, list(grads.values()), scale_name)
        step_graph, layout = append_optimizer(step_graph, groups, grads, skip_if=skip)
        names_before = [v.name for v in step_graph.inputs]
        if self.transform is not None:
            step_graph = self.transform(step_graph)
            if [v.name for v in step_graph.inputs] != names_before:
                raise KilnError("kiln.compile_train: the passes changed the inputs of the training "
                                "graph; passes must keep a graph's signature")
        if self.remat:  # after the user's passes: their CSE would merge the clones back
            step_graph, self.recomputed_nodes = rematerialize(step_graph, loss=layout.kept[0])
            if self.after_remat is not None:
                step_graph = self.after_remat(step_graph)
        self.graph, self.layout = step_graph, layout
        self._skip_output = layout.kept.get(skip) if skip is not None else None
        self._plan = self._input_plan(step_graph, layout, scale_name)
        options = self.options
        if "updated_params" in self.backend.option_defaults:  # the step writes them: no packed copies
            options = {**options, "updated_params": tuple(layout.params)}
        self._executable = self.backend.build(step_graph, options)
        self._writes_into = "out" in inspect.signature(self._executable).parameters
        self._spare = {}
        self.builds += 1

    def _input_plan(self, graph: Graph, layout: UpdateLayout, scale_name: str | None
                    ) -> list[tuple[str, Any]]:
        """How to fill each graph input at a call: ``(kind, detail)`` per input."""
        plan: list[tuple[str, Any] | None] = [None] * len(graph.inputs)
        for i in range(len(self.forward_graph.inputs)):
            plan[i] = ("user", i)
        for slot in layout.hypers:
            plan[slot.input] = ("hyper", (slot.group, slot.name))
        for slot in layout.states:
            plan[slot.input] = ("state", (slot.param, slot.key))
        for param, index in layout.has_buffer.items():
            plan[index] = ("has_buffer", param)
        for i, v in enumerate(graph.inputs):
            if v.name == scale_name:
                plan[i] = ("scale", None)
        missing = [graph.inputs[i].name for i, p in enumerate(plan) if p is None]
        if missing:
            raise KilnError(f"kiln internal error: training graph inputs {missing} have no source")
        return plan  # type: ignore[return-value]

    # ------------------------------------------------------------ run-time feeds
    def _feed(self, entry: tuple[str, Any], tensors: list[torch.Tensor]) -> torch.Tensor:
        kind, detail = entry
        if kind == "user":
            return tensors[detail]
        if kind == "hyper":
            group, name = detail
            return torch.tensor(_hyper(self.optimizer.param_groups[group], name), dtype=torch.float64)
        if kind == "state":
            param, key = detail
            value = self.optimizer.state[self.live[param]].get(key)
            if value is None:
                return _initial_state(key, self.live[param])
            return value
        if kind == "has_buffer":
            buffer = self.optimizer.state[self.live[detail]].get("momentum_buffer")
            return torch.tensor(buffer is not None)
        return torch.tensor(self.scaler.scale, dtype=torch.float32)

    def _write_back(self, outputs: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for name, index in self.layout.params.items():
                self._store(self.live[name], outputs, index)
            for slot in self.layout.states:
                state = self.optimizer.state[self.live[slot.param]]
                current = state.get(slot.key)
                if current is None:
                    state[slot.key] = _fresh_state(slot.key, outputs[slot.output], self.live[slot.param])
                else:
                    self._store(current, outputs, slot.output)

    def _store(self, target: torch.Tensor, outputs: list[torch.Tensor], index: int) -> None:
        """``target`` takes output ``index``'s values: by swapping storages with the step's
        spare buffer when the backend wrote into it and ``target`` owns its storage alone
        (its old storage becomes the next spare), else by a copy."""
        value = outputs[index]
        swap = value is self._spare.get(index) and sole_owner(target)
        if swap:
            old = target.detach()
            target.set_(value)
            self._spare[index] = old
        else:
            target.copy_(value)
            if self._writes_into and target.dim() and sole_owner(target):
                self._spare[index] = torch.empty_like(target, memory_format=torch.contiguous_format)

    # ------------------------------------------------------------- inspection
    @property
    def stats(self) -> dict[str, Any]:
        """Counts of the current step graph and its build; ``planned_*_bytes`` are ``None``
        when the backend reports no memory plan."""
        graph = self.graph
        info = getattr(self._executable, "info", None) or {}
        return {
            "backend": self.backend.name,
            "nodes": len(graph.nodes) if graph is not None else 0,
            "ops": graph.op_histogram() if graph is not None else {},
            "calls": self._calls,
            "skipped_steps": self.skipped_steps,
            "loss_scale": self.loss_scale,
            "remat": self.remat,
            "recomputed_nodes": self.recomputed_nodes,
            "planned_peak_bytes": info.get("arena_bytes"),
            "planned_total_bytes": info.get("intermediate_bytes"),
        }

    def __repr__(self) -> str:
        return (f"<TrainStep {self.optimizer_name} backend={self.backend.name}: "
                f"{len(self.graph.nodes) if self.graph is not None else '?'} nodes>")


# ------------------------------------------------------------------ helpers
def _optimizer_kind(optimizer: Any) -> str:
    kinds = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}
    kind = kinds.get(type(optimizer))
    if kind is None:
        name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        raise KilnError(f"kiln.compile_train does not support the optimizer {name}; supported: "
                        f"{', '.join(SUPPORTED_OPTIMIZERS)}. Run that optimizer eagerly, e.g. with a "
                        "module compiled by kiln.compile and loss.backward()")
    for group in optimizer.param_groups:
        for flag in ("differentiable",):
            if group.get(flag):
                raise KilnError(f"kiln.compile_train does not support {flag}=True optimizers")
    return kind


def _group_spec(kind: str, group: dict[str, Any], params: tuple[str, ...]) -> GroupSpec:
    if kind == "sgd":
        return GroupSpec("sgd", params, momentum=float(group["momentum"]) != 0.0,
                         nesterov=bool(group["nesterov"]), maximize=bool(group.get("maximize")))
    return GroupSpec("adam", params, maximize=bool(group.get("maximize")),
                     decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)),
                     amsgrad=bool(group.get("amsgrad")))


def _hyper(group: dict[str, Any], name: str) -> float:
    if name == "beta1":
        return float(group["betas"][0])
    if name == "beta2":
        return float(group["betas"][1])
    return float(group[name])


def _initial_state(key: str, param: torch.Tensor) -> torch.Tensor:
    """What PyTorch's optimizers start a state entry from (``step`` 0, zero moments)."""
    if key == "step":
        return torch.tensor(0.0, dtype=torch.float32)
    return torch.zeros_like(param, memory_format=torch.preserve_format)


def _fresh_state(key: str, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A new state tensor holding ``value`` (kiln's outputs may share memory it reuses)."""
    if key == "step":
        return value.detach().clone().to(torch.float32)
    out = torch.empty_like(param, memory_format=torch.preserve_format)
    out.copy_(value)
    return out


def _same_constant(expected: Any, got: Any) -> bool:
    try:
        return type(expected) is type(got) and bool(expected == got)
    except Exception:  # noqa: BLE001 - objects whose == is not a plain bool never match
        return expected is got


def _fits(got: TensorType, want: TensorType) -> bool:
    """Whether an argument of type ``got`` may feed an input of type ``want``: equal types, or
    the same dtype and rank where ``want`` is symbolic (its sizes are bound and checked after)."""
    if want.is_static:
        return got == want
    return got.dtype == want.dtype and got.rank == want.rank


def _type_of(value: torch.Tensor) -> TensorType | None:
    try:
        return tensor_type(value)
    except TypeError:
        return None


__all__ = ["SUPPORTED_OPTIMIZERS", "TrainStep", "compile_train"]
