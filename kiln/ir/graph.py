"""The graph IR: typed SSA values, nodes and graphs.

* A :class:`Value` is defined exactly once: as a graph input, a parameter, a constant, or a
  result of a :class:`Node`.  Its :class:`TensorType` is fixed when it is made.
* A :class:`Node` applies one registered op to operand values; its result types come from
  the op's inference rule, run when the node is built, so ill-typed nodes cannot exist.
* A :class:`Graph` holds user inputs and parameters (kept apart), constants (stored once,
  deduplicated by content), nodes in topological order, and outputs.

Passes are functional: they never edit the graph they are given.  They ``clone()`` it and
edit the clone with the mutators below (``add_node``, ``replace_all_uses``, ``remove_node``,
``sort``), then return the clone.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .errors import OpTypeError
from .registry import OpDef, get_op
from .types import DType, SizeRange, TensorType

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$|^[0-9]+$")


class Value:
    """An SSA value. Compared and hashed by identity."""

    __slots__ = ("name", "type", "origin", "producer", "index", "data")

    def __init__(self, name: str, type: TensorType, origin: str, producer: Node | None = None,
                 index: int = 0, data: np.ndarray | None = None):
        self.name = name
        self.type = type
        self.origin = origin  # "input" | "param" | "const" | "result"
        self.producer = producer
        self.index = index
        self.data = data

    @property
    def shape(self):
        return self.type.shape

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    @property
    def is_const(self) -> bool:
        return self.origin == "const"

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


class Node:
    """One op application. ``outputs`` are the node's result values."""

    __slots__ = ("op", "inputs", "attrs", "outputs", "loc")

    def __init__(self, op: OpDef, inputs: tuple[Value, ...], attrs: dict[str, Any],
                 outputs: tuple[Value, ...] = (), loc: str | None = None):
        self.op = op
        self.inputs = inputs
        self.attrs = attrs
        self.outputs = outputs
        self.loc = loc

    @property
    def op_name(self) -> str:
        """The op's registered name, e.g. ``"add"``."""
        return self.op.name

    @property
    def output(self) -> Value:
        if len(self.outputs) != 1:
            raise ValueError(f"node {self.op_name} has {len(self.outputs)} results, not one")
        return self.outputs[0]

    def __repr__(self) -> str:
        outs = ", ".join(f"%{v.name}" for v in self.outputs)
        ins = ", ".join(f"%{v.name}" for v in self.inputs)
        return f"<Node {outs} = {self.op_name}({ins})>"


def _const_key(data: np.ndarray) -> tuple:
    digest = hashlib.blake2b(np.array(data, order="C").tobytes(), digest_size=16).hexdigest()
    return (data.dtype.str, data.shape, digest)


class Graph:
    """A typed SSA graph. See the module docstring."""

    def __init__(self, name: str = "main"):
        self.name = name
        self.inputs: list[Value] = []
        self.params: list[Value] = []
        self.constants: list[Value] = []
        self.nodes: list[Node] = []
        self.outputs: list[Value] = []
        self.sizes: dict[str, SizeRange] = {}
        """The range of each named size of the graph's symbolic shapes."""
        self._names: set[str] = set()
        self._const_index: dict[tuple, Value] = {}
        self._next_id = 0

    # ----------------------------------------------------------------- naming
    def fresh_name(self, hint: str | None = None) -> str:
        """A value name not used in this graph; ``hint`` is sanitized and kept if free."""
        if hint:
            hint = re.sub(r"[^A-Za-z0-9_.]", "_", hint)
            if not _NAME_RE.match(hint):
                hint = "v_" + hint
            if hint not in self._names:
                self._names.add(hint)
                return hint
            base = hint
        else:
            base = None
        while True:
            n = self._next_id
            self._next_id += 1
            name = f"{base}_{n}" if base else str(n)
            if name not in self._names:
                self._names.add(name)
                return name

    def _claim(self, name: str) -> str:
        """Reserve ``name``: any non-empty string (names from PyTorch are data: ``0.weight``,
        ``ModuleDict`` keys; the text form quotes what is not a plain identifier)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"invalid value name {name!r}: a value name is a non-empty string")
        if name in self._names:
            raise ValueError(f"value name %{name} is already defined in graph @{self.name}")
        self._names.add(name)
        return name

    # ------------------------------------------------------------ definitions
    def add_input(self, name: str, type: TensorType) -> Value:
        v = Value(self._claim(name), type, "input")
        self.inputs.append(v)
        return v

    def add_param(self, name: str, type: TensorType) -> Value:
        v = Value(self._claim(name), type, "param")
        self.params.append(v)
        return v

    def add_constant(self, data: Any, dtype: DType | None = None, name: str | None = None,
                     *, dedup: bool = True) -> Value:
        """A constant value; identical contents are stored once and share one value.

        ``name`` is a hint by default.  With ``dedup=False`` a new value is always made and
        ``name``, when given, is used verbatim (``ValueError`` if it is taken); the text
        parser uses this so every written constant keeps its own name.
        """
        arr = np.asarray(data, dtype=dtype.numpy if dtype else None)
        if dtype is None and arr.dtype == np.float64 and not isinstance(data, np.ndarray):
            arr = arr.astype(np.float32)  # python floats default to float32, as in torch
        kdt = DType.from_numpy(arr.dtype)
        key = _const_key(arr)
        hit = self._const_index.get(key)
        if hit is not None and dedup:
            return hit
        arr = np.array(arr, copy=True, order="C")
        arr.setflags(write=False)
        vname = self._claim(name) if name is not None and not dedup else self.fresh_name(name or "c")
        v = Value(vname, TensorType(tuple(arr.shape), kdt), "const", data=arr)
        self.constants.append(v)
        self._const_index.setdefault(key, v)
        return v

    def add_node(self, op: str | OpDef, inputs: Sequence[Value], attrs: Mapping[str, Any] | None = None,
                 *, names: Sequence[str] | None = None, loc: str | None = None,
                 before: Node | None = None, after: Node | None = None) -> Node:
        """Build a node, infer its result types, and insert it (at the end by default)."""
        opdef = op if isinstance(op, OpDef) else get_op(op)
        inputs = tuple(inputs)
        for i, v in enumerate(inputs):
            if not isinstance(v, Value):
                raise OpTypeError(opdef.name, f"operand {i} is {type(v).__name__}, not a Value", loc=loc)
        try:
            norm = opdef.normalize_attrs(attrs or {})
            types = opdef.infer_types([v.type for v in inputs], norm)
        except OpTypeError as e:
            raise OpTypeError(opdef.name, str(e).split(": ", 1)[-1], [v.type for v in inputs],
                              attrs, loc) from None
        node = Node(opdef, inputs, norm, loc=loc)
        if names is not None and len(names) != len(types):
            raise ValueError(f"{opdef.name}: {len(names)} names for {len(types)} results")
        node.outputs = tuple(
            Value(self._claim(names[i]) if names else self.fresh_name(), t, "result", node, i)
            for i, t in enumerate(types)
        )
        if before is not None:
            self.nodes.insert(self.nodes.index(before), node)
        elif after is not None:
            self.nodes.insert(self.nodes.index(after) + 1, node)
        else:
            self.nodes.append(node)
        return node

    def op(self, op: str, *inputs: Value, loc: str | None = None, **attrs: Any) -> Value:
        """Shorthand for single-result nodes: ``g.op("add", x, y)`` returns the result."""
        return self.add_node(op, inputs, attrs, loc=loc).output

    def set_outputs(self, values: Iterable[Value]) -> None:
        self.outputs = list(values)

    # ---------------------------------------------------------------- queries
    def values(self) -> Iterator[Value]:
        """Every value in definition order: inputs, params, constants, node results."""
        yield from self.inputs
        yield from self.params
        yield from self.constants
        for n in self.nodes:
            yield from n.outputs

    def users(self) -> dict[Value, list[Node]]:
        """Map from each value to the nodes that use it (a node appears once per use)."""
        out: dict[Value, list[Node]] = {v: [] for v in self.values()}
        for n in self.nodes:
            for v in n.inputs:
                out.setdefault(v, []).append(n)
        return out

    def op_histogram(self) -> dict[str, int]:
        hist: dict[str, int] = {}
        for n in self.nodes:
            hist[n.op_name] = hist.get(n.op_name, 0) + 1
        return dict(sorted(hist.items()))

    # -------------------------------------------------------------- mutation
    def replace_all_uses(self, old: Value, new: Value) -> None:
        """Make every use of ``old`` (operands and outputs) use ``new`` instead."""
        if old is new:
            return
        if old.type != new.type:
            raise OpTypeError("replace_all_uses", f"%{old.name}: {old.type} replaced by %{new.name}: {new.type}")
        for n in self.nodes:
            if old in n.inputs:
                n.inputs = tuple(new if v is old else v for v in n.inputs)
        self.outputs = [new if v is old else v for v in self.outputs]

    def remove_node(self, node: Node) -> None:
        self.nodes.remove(node)
        for v in node.outputs:
            self._names.discard(v.name)

    def remove_unused_constants(self) -> bool:
        used = {v for n in self.nodes for v in n.inputs} | set(self.outputs)
        keep = [c for c in self.constants if c in used]
        if len(keep) == len(self.constants):
            return False
        for c in self.constants:
            if c not in used:
                self._names.discard(c.name)
                key = _const_key(c.data)
                if self._const_index.get(key) is c:  # an equal, still-used twin keeps the entry
                    del self._const_index[key]
        self.constants = keep
        return True

    def sort(self) -> None:
        """Stable topological sort of ``nodes`` (keeps the current order where legal)."""
        producer = {v: n for n in self.nodes for v in n.outputs}
        order: list[Node] = []
        state: dict[Node, int] = {}
        for root in self.nodes:
            if root in state:
                continue
            stack = [(root, iter(root.inputs))]
            state[root] = 1
            while stack:
                node, it = stack[-1]
                for v in it:
                    p = producer.get(v)
                    if p is None or state.get(p) == 2:
                        continue
                    if state.get(p) == 1:
                        raise ValueError(f"cycle through node {p!r}")
                    state[p] = 1
                    stack.append((p, iter(p.inputs)))
                    break
                else:
                    stack.pop()
                    state[node] = 2
                    order.append(node)
        self.nodes = order

    # ----------------------------------------------------------------- copies
    def clone(self) -> Graph:
        """A deep copy of the structure (constant data and nested graphs are shared)."""
        return self.clone_with_map()[0]

    def clone_with_map(self) -> tuple[Graph, dict[Value, Value]]:
        g = Graph(self.name)
        g.sizes = dict(self.sizes)
        g._names = set(self._names)
        g._next_id = self._next_id
        vmap: dict[Value, Value] = {}
        for src, dst in ((self.inputs, g.inputs), (self.params, g.params), (self.constants, g.constants)):
            for v in src:
                nv = Value(v.name, v.type, v.origin, data=v.data)
                vmap[v] = nv
                dst.append(nv)
        g._const_index = {_const_key(c.data): c for c in g.constants}
        for n in self.nodes:
            nn = Node(n.op, tuple(vmap[v] for v in n.inputs), dict(n.attrs), loc=n.loc)
            nn.outputs = tuple(Value(v.name, v.type, "result", nn, v.index) for v in n.outputs)
            vmap.update(zip(n.outputs, nn.outputs))
            g.nodes.append(nn)
        g.outputs = [vmap[v] for v in self.outputs]
        return g, vmap

    # ------------------------------------------------------------------- text
    def format(self, locs: bool = False) -> str:
        from .printer import format_graph

        return format_graph(self, locs=locs)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return (f"<Graph @{self.name}: {len(self.inputs)} inputs, {len(self.params)} params, "
                f"{len(self.constants)} constants, {len(self.nodes)} nodes>")
