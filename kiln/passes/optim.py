"""Optimizer updates expressed in the graph IR: SGD and Adam/AdamW, op for op as PyTorch.

:func:`append_optimizer` takes a graph whose outputs include the gradients of some of its
params (a joint graph from :mod:`kiln.passes.autodiff`) and returns a new graph that also
computes the optimizer step: the new value of every updated param and the new optimizer
state are extra outputs.  The update is made of ordinary ops (``mul``, ``add``, ``sqrt``,
``where``...), so every later pass -- CSE, fusion -- sees it like any other code.

Guarantees:

* Hyperparameters are graph *inputs* (``f64[]`` scalars named ``opt.<group>.<name>``), so a
  learning-rate scheduler that edits ``group["lr"]`` is honoured without rebuilding the
  graph.  Only structure is fixed at build time: which params are updated, SGD's use of a
  momentum buffer (``momentum != 0``), ``nesterov``, ``maximize``, Adam's
  ``decoupled_weight_decay`` (AdamW) and ``amsgrad``.
* State is graph inputs and outputs in PyTorch's layout: per param ``momentum_buffer``
  (SGD), or ``step`` (``f32[]``), ``exp_avg``, ``exp_avg_sq`` and, with amsgrad,
  ``max_exp_avg_sq`` (Adam).  SGD's first step (no buffer yet: PyTorch copies the gradient
  into the buffer) is selected by a ``bool[]`` input per param, so it needs no second graph.
* The arithmetic follows ``torch.optim``'s single-tensor code paths operation by operation
  (e.g. ``lerp``'s two forms, ``addcdiv`` as ``p + value * (a / b)``).  As there, the scalar
  arithmetic on hyperparameters (``1 - beta2``, ``1 - lr * weight_decay``, the bias
  corrections ``1 - beta ** step``, ``lr / bias_correction1``, ``sqrt(bias_correction2)``)
  is done in float64 -- PyTorch does it in Python floats -- and each scalar is rounded to
  float32 where it meets a tensor; the tensor arithmetic is float32.  (In float32,
  ``1 - 0.999`` is off by 1.3e-5 relative: every Adam update would be scaled by the same
  wrong factor, a bias along the gradient that ill-conditioned losses amplify.)  Results are
  cast back to each param's and state's dtype.
* With ``skip_if`` (the output index of a ``bool[]``), every new param and state value is
  ``where(skip, old, new)``: a skipped step leaves everything unchanged (AMP loss scaling).
* The input graph is not modified.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kiln.ir import DType, Graph, KilnError, TensorType, Value
from kiln.ir.builder import GraphBuilder
from kiln.ir.names import claim_name

SGD_HYPERS = ("lr", "momentum", "dampening", "weight_decay")
ADAM_HYPERS = ("lr", "beta1", "beta2", "eps", "weight_decay")
_SCALAR = TensorType((), DType.float32)
_HYPER = TensorType((), DType.float64)


@dataclass(frozen=True)
class GroupSpec:
    """The structure of one param group; hyperparameter values are supplied at run time.

    ``optimizer`` is ``"sgd"`` or ``"adam"``; ``params`` are graph param names.  ``momentum``
    (SGD) says the group keeps momentum buffers (PyTorch skips them when momentum is 0).
    ``decoupled_weight_decay`` (Adam) selects AdamW's decay of the weights over Adam's L2
    term in the gradient.
    """

    optimizer: str
    params: tuple[str, ...]
    momentum: bool = False
    nesterov: bool = False
    maximize: bool = False
    decoupled_weight_decay: bool = True
    amsgrad: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in ("sgd", "adam"):
            raise KilnError(f"kiln: unknown optimizer {self.optimizer!r}; known: 'sgd', 'adam'")
        if self.nesterov and not self.momentum:
            raise KilnError("kiln: SGD with nesterov=True needs momentum > 0 (as in torch.optim.SGD)")

    @property
    def hypers(self) -> tuple[str, ...]:
        return SGD_HYPERS if self.optimizer == "sgd" else ADAM_HYPERS

    @property
    def state_keys(self) -> tuple[str, ...]:
        if self.optimizer == "sgd":
            return ("momentum_buffer",) if self.momentum else ()
        return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())


@dataclass(frozen=True)
class HyperSlot:
    """Graph input ``input`` carries hyperparameter ``name`` of param group ``group``."""

    group: int
    name: str
    input: int


@dataclass(frozen=True)
class StateSlot:
    """Optimizer state ``key`` of param ``param``: read from input ``input``, written to
    output ``output``.  ``key`` is PyTorch's state key (``"exp_avg"``, ``"step"``...)."""

    param: str
    key: str
    input: int
    output: int


@dataclass(frozen=True)
class UpdateLayout:
    """Where :func:`append_optimizer` put things in the new graph.

    ``kept``: old output index -> new output index, for the outputs that are not gradients
    (gradient outputs are consumed by the update and dropped).  ``params``: param name ->
    output index of its updated value.  ``has_buffer``: param name -> index of the ``bool[]``
    input saying whether its SGD momentum buffer exists yet.
    """

    hypers: tuple[HyperSlot, ...]
    states: tuple[StateSlot, ...]
    params: dict[str, int]
    kept: dict[int, int]
    has_buffer: dict[str, int] = field(default_factory=dict)


def append_optimizer(graph: Graph, groups: Sequence[GroupSpec], grads: Mapping[str, int], *,
                     skip_if: int | None = None) -> tuple[Graph, UpdateLayout]:
    """A copy of ``graph`` that also computes the optimizer step (see the module docstring).

    Args:
        graph: a graph whose outputs include the gradient of every updated param.
        groups: the param groups, in the optimizer's order.
        grads: param name -> index of the output holding that param's gradient.
        skip_if: index of a ``bool[]`` output; when true at run time the step is skipped.
    """
    g = graph.clone()
    params = {v.name: v for v in g.params}
    _check_groups(graph, groups, grads, params, skip_if)
    builder = _UpdateBuilder(g)
    skip = g.outputs[skip_if] if skip_if is not None else None
    new_params: dict[str, Value] = {}
    new_states: list[tuple[str, str, Value, Value]] = []  # param, key, input, new value
    hyper_slots: list[tuple[int, str, Value]] = []
    has_buffer: dict[str, Value] = {}
    for index, group in enumerate(groups):
        hypers = {}
        for name in group.hypers:
            v = builder.input(f"opt.{index}.{name}", _HYPER)
            hypers[name] = v
            hyper_slots.append((index, name, v))
        for pname in group.params:
            param = params[pname]
            grad = g.outputs[grads[pname]]
            state = {key: builder.input(f"{pname}.{key}", _state_type(param, key))
                     for key in group.state_keys}
            if group.optimizer == "sgd":
                flag = builder.input(f"{pname}.has_momentum_buffer", TensorType((), DType.bool)) \
                    if group.momentum else None
                if flag is not None:
                    has_buffer[pname] = flag
                new_p, new_s = builder.sgd(group, param, grad, hypers, state, flag)
            else:
                new_p, new_s = builder.adam(group, param, grad, hypers, state)
            if skip is not None:
                new_p = builder.keep_if(skip, param, new_p)
                new_s = {k: builder.keep_if(skip, state[k], v) for k, v in new_s.items()}
            new_params[pname] = new_p
            new_states.extend((pname, key, state[key], new_s[key]) for key in group.state_keys)
    grad_indices = set(grads.values())
    kept = [i for i in range(len(g.outputs)) if i not in grad_indices]
    outputs = [g.outputs[i] for i in kept]
    param_out = {}
    for pname, value in new_params.items():
        param_out[pname] = len(outputs)
        outputs.append(value)
    state_slots = []
    for pname, key, inp, value in new_states:
        state_slots.append(StateSlot(pname, key, g.inputs.index(inp), len(outputs)))
        outputs.append(value)
    g.set_outputs(outputs)
    layout = UpdateLayout(
        hypers=tuple(HyperSlot(gi, name, g.inputs.index(v)) for gi, name, v in hyper_slots),
        states=tuple(state_slots), params=param_out,
        kept={old: new for new, old in enumerate(kept)},
        has_buffer={p: g.inputs.index(v) for p, v in has_buffer.items()},
    )
    return g, layout


def _state_type(param: Value, key: str) -> TensorType:
    return _SCALAR if key == "step" else param.type


def _check_groups(graph: Graph, groups: Sequence[GroupSpec], grads: Mapping[str, int],
                  params: Mapping[str, Value], skip_if: int | None) -> None:
    seen: set[str] = set()
    for group in groups:
        for name in group.params:
            if name not in params:
                raise KilnError(f"kiln: optimizer param '{name}' is not a param of graph @{graph.name}")
            if name in seen:
                raise KilnError(f"kiln: param '{name}' appears in more than one param group")
            seen.add(name)
            if name not in grads:
                raise KilnError(f"kiln: no gradient output given for param '{name}'")
            index = grads[name]
            if not 0 <= index < len(graph.outputs) or graph.outputs[index].type != params[name].type:
                got = graph.outputs[index].type if 0 <= index < len(graph.outputs) else "nothing"
                raise KilnError(f"kiln: gradient output {index} of param '{name}' is {got}, "
                                f"expected {params[name].type}")
            if not params[name].dtype.is_floating:
                raise KilnError(f"kiln: param '{name}' is {params[name].type}; only floating-point "
                                "params can be optimized")
    if skip_if is not None and graph.outputs[skip_if].type != TensorType((), DType.bool):
        raise KilnError(f"kiln: skip_if output {skip_if} is {graph.outputs[skip_if].type}, "
                        "expected bool[]")


class _UpdateBuilder(GraphBuilder):
    """Adds the update ops for one param at a time (each located at ``"optimizer"``): tensor
    arithmetic in float32, scalar arithmetic on the (float64) hyperparameters in float64,
    rounded to float32 by :meth:`scalar` where a scalar meets a tensor."""

    def __init__(self, graph: Graph):
        super().__init__(graph, loc="optimizer")
        self.used = {v.name for v in graph.values()}

    # -------------------------------------------------------------- plumbing
    def input(self, hint: str, type: TensorType) -> Value:
        return self.graph.add_input(claim_name(hint, self.used), type)

    def scalar(self, v: Value) -> Value:
        """A float64 scalar as the float32 operand of tensor arithmetic (PyTorch converts a
        Python-float operand of a float32 kernel to float32)."""
        return self.f32(v)

    def one_minus64(self, v: Value) -> Value:
        """``1 - v`` in float64 (``v`` a float64 scalar)."""
        return self.sub(self.const(1.0, DType.float64), v)

    def f32(self, v: Value) -> Value:
        return self.cast(v, DType.float32)

    def like(self, v: Value, ref: Value) -> Value:
        return self.cast(v, ref.dtype)

    def keep_if(self, skip: Value, old: Value, new: Value) -> Value:
        return self.where(skip, old, new)

    def axpy(self, alpha: Value, x: Value, y: Value) -> Value:
        """``y + alpha * x``: PyTorch's ``y.add(x, alpha=alpha)``."""
        return self.op("add", y, self.op("mul", x, alpha))

    def one_minus(self, v: Value) -> Value:
        return self.op("sub", self.const(1.0, DType.float32), v)

    # ------------------------------------------------------------------ sgd
    def sgd(self, group: GroupSpec, param: Value, grad: Value, h: Mapping[str, Value],
            state: Mapping[str, Value], has_buffer: Value | None) -> tuple[Value, dict[str, Value]]:
        p, g = self.f32(param), self.f32(grad)
        if group.maximize:
            g = self.op("neg", g)
        g = self.axpy(self.scalar(h["weight_decay"]), p, g)
        new_state: dict[str, Value] = {}
        if group.momentum:
            buf = self.f32(state["momentum_buffer"])
            momentum = self.scalar(h["momentum"])
            decayed = self.axpy(self.scalar(self.one_minus64(h["dampening"])), g,
                                self.op("mul", buf, momentum))
            buf = self.op("where", has_buffer, decayed, g)  # first step: the buffer is the gradient
            new_state["momentum_buffer"] = self.like(buf, state["momentum_buffer"])
            g = self.axpy(momentum, buf, g) if group.nesterov else buf
        p = self.axpy(self.scalar(self.op("neg", h["lr"])), g, p)
        return self.like(p, param), new_state

    # ----------------------------------------------------------------- adam
    def adam(self, group: GroupSpec, param: Value, grad: Value, h: Mapping[str, Value],
             state: Mapping[str, Value]) -> tuple[Value, dict[str, Value]]:
        p, g = self.f32(param), self.f32(grad)
        if group.maximize:
            g = self.op("neg", g)
        step = self.op("add", self.f32(state["step"]), self.const(1.0, DType.float32))
        step64 = self.op("cast", step, dtype=DType.float64)  # PyTorch's step.item()
        lr, wd = h["lr"], h["weight_decay"]
        if group.decoupled_weight_decay:
            p = self.op("mul", p, self.scalar(self.one_minus64(self.op("mul", lr, wd))))
        else:
            g = self.axpy(self.scalar(wd), p, g)
        exp_avg = self._lerp(self.f32(state["exp_avg"]), g, self.scalar(self.one_minus64(h["beta1"])))
        beta2 = h["beta2"]
        exp_avg_sq = self.op("add", self.op("mul", self.f32(state["exp_avg_sq"]), self.scalar(beta2)),
                             self.op("mul", self.op("mul", g, self.scalar(self.one_minus64(beta2))), g))
        bias1 = self.one_minus64(self.op("pow", h["beta1"], step64))
        bias2 = self.one_minus64(self.op("pow", beta2, step64))
        step_size = self.op("div", lr, bias1)
        second = exp_avg_sq
        new_state = {"step": self.like(step, state["step"]),
                     "exp_avg": self.like(exp_avg, state["exp_avg"]),
                     "exp_avg_sq": self.like(exp_avg_sq, state["exp_avg_sq"])}
        if group.amsgrad:
            second = self.op("maximum", self.f32(state["max_exp_avg_sq"]), exp_avg_sq)
            new_state["max_exp_avg_sq"] = self.like(second, state["max_exp_avg_sq"])
        denom = self.op("add", self.op("div", self.op("sqrt", second), self.scalar(self.op("sqrt", bias2))),
                        self.scalar(h["eps"]))
        p = self.axpy(self.scalar(self.op("neg", step_size)), self.op("div", exp_avg, denom), p)
        return self.like(p, param), new_state

    def _lerp(self, start: Value, end: Value, weight: Value) -> Value:
        """``torch.lerp``: ``start + w * (end - start)`` for ``w < 0.5``, else
        ``end - (end - start) * (1 - w)`` (the two forms of PyTorch's kernel)."""
        diff = self.op("sub", end, start)
        low = self.op("add", start, self.op("mul", weight, diff))
        high = self.op("sub", end, self.op("mul", diff, self.one_minus(weight)))
        return self.op("where", self.op("lt", weight, self.const(0.5, DType.float32)), low, high)
