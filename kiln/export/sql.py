"""DuckDB serving: kiln models as arrow UDFs (:func:`duckdb_udf`) and as SQL (:func:`to_sql`).

**UDFs.**  DuckDB calls an arrow UDF with ``pyarrow`` arrays of up to 2,048 rows (one per
parameter) and expects an array of as many rows back; Python UDFs run one at a time.  Rows
are feature vectors: one fixed-size ``FLOAT[n]`` column, or ``n`` ``FLOAT`` columns
(``columns=True``).  The compiled model sees ``[rows, n]`` float32 batches: a model
compiled for a static batch size ``B`` gets chunks of ``B`` rows (the last one padded, its
padding dropped); one compiled with a dynamic batch size (``dynamic_shapes``) gets whole
batches, chunked by its range maximum and padded up to its minimum.

DuckDB calls UDFs from its own worker threads, each time under a fresh Python thread
state.  The compiled model keeps per-thread workspaces (its arena and bound calls,
:mod:`kiln.runtime.call_plan`), which such a thread would rebuild at every call and drop
when DuckDB deletes the thread state; so the UDF hands each batch to one long-lived
Python thread that owns the model's workspace, and waits for it.

**SQL.**  :func:`to_sql` lowers a captured MLP graph (``kiln.capture``) to one query over a
table of ``(key, v FLOAT[n])`` rows.  Activations between layers are either *dense* rows
``(key, v FLOAT[n])`` or *long* rows ``(key, j, v)``:

* ``matmul`` with a weight (``permute`` of a ``[m, n]`` param) and the ``add`` of its bias:
  the dense rows joined with the layer's relation ``(j, w FLOAT[n], b FLOAT)`` (one row per
  output unit) giving long rows ``array_inner_product(v, w) + b``;
* elementwise ``relu`` / ``add`` of a bias on long rows: ``GREATEST(v, 0)`` / a join on ``j``;
* ``softmax`` over the last axis: ``exp(v - max) / sum(exp(v - max))`` with windows
  partitioned by the key;
* long rows are packed back to dense ones (``list(v ORDER BY j)``) before a matmul and at
  the end, so the query returns ``(key, v FLOAT[m])``.

Any other op is refused, naming it.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kiln.ir import Graph, KilnError, SymDim, Value


# ------------------------------------------------------------------------------ UDFs
def duckdb_udf(compiled: Any, con: Any, name: str, *, columns: bool = False) -> None:
    """Register ``compiled`` (a kiln-compiled model of one ``[batch, n]`` float32 input and
    one ``[batch, m]`` or ``[batch]`` output) on DuckDB connection ``con`` as the arrow UDF
    ``name``: ``name(v FLOAT[n])``, or ``name(x1, ..., xn)`` with ``columns=True``.  It
    returns ``FLOAT[m]`` (``FLOAT`` for a ``[batch]`` output)."""
    import duckdb
    import pyarrow as pa
    from duckdb import sqltypes

    graph = compiled.graph
    (x,) = graph.inputs if len(graph.inputs) == 1 else (None,)
    if x is None or x.type.rank != 2 or not isinstance(x.type.shape[1], int):
        raise KilnError(f"duckdb_udf: the model must take one [batch, n] tensor with a static n; "
                        f"@{graph.name} takes {', '.join(str(v.type) for v in graph.inputs)}")
    out = graph.outputs[0].type
    if len(graph.outputs) != 1 or out.rank not in (1, 2) or (out.rank == 2 and not isinstance(out.shape[1], int)):
        raise KilnError(f"duckdb_udf: the model must return one [batch, m] or [batch] tensor; @{graph.name} "
                        f"returns {', '.join(str(v.type) for v in graph.outputs)}")
    n = x.type.shape[1]
    m = out.shape[1] if out.rank == 2 else None
    run = _batch_runner(compiled, x.type.shape[0], graph.sizes)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kiln-udf-{name}")
    weakref.finalize(con, worker.shutdown, wait=False)

    def result(rows: np.ndarray) -> Any:
        y = worker.submit(run, rows).result()
        if m is None:
            return pa.array(y.reshape(-1))
        return pa.FixedSizeListArray.from_arrays(pa.array(y.reshape(-1)), m)

    if columns:
        def udf(*arrays: Any) -> Any:
            return result(np.stack([_numpy(a) for a in arrays], axis=1).astype(np.float32, copy=False))

        udf.__signature__ = inspect.Signature(  # DuckDB counts the function's parameters
            [inspect.Parameter(f"x{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD) for i in range(n)])
        parameters = [sqltypes.FLOAT] * n
    else:
        def udf(array: Any) -> Any:
            flat = array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array
            return result(_numpy(flat.flatten()).reshape(len(flat), n).astype(np.float32, copy=False))

        parameters = [duckdb.array_type(sqltypes.FLOAT, n)]
    returns = sqltypes.FLOAT if m is None else duckdb.array_type(sqltypes.FLOAT, m)
    con.create_function(name, udf, parameters, returns, type="arrow")


def _numpy(array: Any) -> np.ndarray:
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    return array.to_numpy(zero_copy_only=False)


def _batch_runner(compiled: Any, batch: Any, ranges: Mapping[str, Any]) -> Callable[[np.ndarray], np.ndarray]:
    """``run(rows [r, n]) -> outputs [r, ...]``: the rows in chunks the compiled model takes."""
    if isinstance(batch, int):
        lo = hi = batch
    elif isinstance(batch, SymDim) and batch.is_symbol:
        r = ranges.get(batch.name)
        lo, hi = (r.lo, r.hi) if r is not None else (2, None)
    else:
        raise KilnError(f"duckdb_udf: the batch size {batch} is neither static nor one named size")

    def run(rows: np.ndarray) -> np.ndarray:
        pieces = []
        step = hi or len(rows)
        with torch.no_grad():
            for start in range(0, len(rows), step):
                chunk = torch.from_numpy(np.array(rows[start:start + step], dtype=np.float32))
                count = len(chunk)
                if count < lo:
                    chunk = torch.cat([chunk, chunk.new_zeros(lo - count, chunk.shape[1])])
                y = compiled(chunk)
                pieces.append(y[:count].numpy())
        return np.concatenate(pieces) if pieces else np.zeros((0,), np.float32)

    return run


# ------------------------------------------------------------------------------ SQL
@dataclass
class SqlPlan:
    """The SQL form of a model: ``query`` reads ``(key, v FLOAT[n])`` rows from ``table``
    and returns ``(key, v FLOAT[m])``; ``relations`` are the weight relations it joins
    (name -> pyarrow table), created by :meth:`install`."""

    query: str
    relations: dict[str, Any] = field(default_factory=dict)

    def install(self, con: Any) -> None:
        """Create (or replace) the weight relations on DuckDB connection ``con``."""
        for name, table in self.relations.items():
            con.register(f"{name}__arrow", table)
            con.execute(f"CREATE OR REPLACE TABLE {name} AS SELECT * FROM {name}__arrow")
            con.unregister(f"{name}__arrow")


def to_sql(model: torch.nn.Module | Graph, example_or_params: Any, *, table: str, key: str = "id",
           column: str = "v", prefix: str = "kiln") -> SqlPlan:
    """The relation-centric SQL plan of an MLP (see the module docstring): ``to_sql(model,
    example_inputs, table=...)`` captures ``model``; ``to_sql(graph, params, table=...)``
    lowers a kiln graph with ``params`` (graph param name -> tensor)."""
    if isinstance(model, torch.nn.Module):
        from kiln.frontends.torch.capture import capture_program, export_program

        args = example_or_params if isinstance(example_or_params, tuple) else (example_or_params,)
        captured = capture_program(export_program(model.eval(), args), name=type(model).__name__)
        graph, params = captured.graph, captured.params
    else:
        graph, params = model, example_or_params
    values = _param_values(graph, params)
    if len(graph.inputs) != 1 or graph.inputs[0].type.rank != 2 or len(graph.outputs) != 1:
        raise KilnError(f"to_sql: @{graph.name} must take one [batch, n] input and return one tensor")
    lower = _Lowering(values, prefix, graph.users())
    lower.ctes.append(f"{prefix}_in AS (SELECT {key} AS key, {column}::FLOAT[] AS v FROM {table})")
    lower.form[graph.inputs[0]] = ("dense", f"{prefix}_in")
    for node in graph.nodes:
        lower.node(node)
    out = graph.outputs[0]
    if out not in lower.form:
        raise KilnError(f"to_sql: the output %{out.name} is not computed from the input")
    kind, rel = lower.form[out]
    width = out.type.shape[-1]
    final = rel if kind == "dense" else lower.pack(rel)
    query = "WITH " + ",\n     ".join(lower.ctes) + \
        f"\nSELECT key AS {key}, v::FLOAT[{width}] AS {column} FROM {final}"
    return SqlPlan(query, lower.relations)


class _Lowering:
    def __init__(self, params: dict[str, np.ndarray], prefix: str, users: dict[Value, list[Any]]):
        self.params = params
        self.users = users
        self.prefix = prefix
        self.ctes: list[str] = []
        self.relations: dict[str, Any] = {}
        self.form: dict[Value, tuple[str, str]] = {}
        """Activation value -> (``dense`` or ``long``, CTE name)."""
        self.weights: dict[Value, np.ndarray] = {}
        """Transposed weights (``permute`` of a param): value -> the param's ``[m, n]`` array."""

    def cte(self, body: str) -> str:
        name = f"{self.prefix}_{len(self.ctes)}"
        self.ctes.append(f"{name} AS ({body})")
        return name

    def pack(self, long: str) -> str:
        return self.cte(f"SELECT key, list(v ORDER BY j) AS v FROM {long} GROUP BY key")

    def node(self, node: Any) -> None:
        op, ins = node.op_name, node.inputs
        if op == "permute" and ins[0].origin == "param" and tuple(node.attrs["dims"]) == (1, 0):
            self.weights[node.outputs[0]] = self.params[ins[0].name]
            return
        if op == "matmul" and ins[0] in self.form and ins[1] in self.weights:
            kind, rel = self.form[ins[0]]
            dense = rel if kind == "dense" else self.pack(rel)
            weight = self.weights[ins[1]]
            bias = self._bias_of(node)
            name = f"{self.prefix}_w{len(self.relations)}"
            self.relations[name] = _weight_relation(weight, bias)
            out = self.cte(f"SELECT h.key, w.j, array_inner_product(h.v::FLOAT[{weight.shape[1]}], w.w) + w.b AS v "
                           f"FROM {dense} h CROSS JOIN {name} w")
            self.form[node.outputs[0]] = ("long", out)
            if bias is not None:  # the add consumed by this layer's relation
                self.form[bias[1]] = ("long", out)
            return
        if node.outputs[0] in self.form:
            return  # a bias add folded into its layer
        if op == "relu" and ins[0] in self.form:
            rel = self._long(ins[0])
            self.form[node.outputs[0]] = ("long", self.cte(f"SELECT key, j, GREATEST(v, 0.0) AS v FROM {rel}"))
            return
        if op == "add" and ins[0] in self.form and ins[1].origin == "param" and ins[1].type.rank == 1:
            rel = self._long(ins[0])
            name = f"{self.prefix}_b{len(self.relations)}"
            self.relations[name] = _bias_relation(self.params[ins[1].name])
            self.form[node.outputs[0]] = ("long", self.cte(
                f"SELECT h.key, h.j, h.v + b.b AS v FROM {rel} h JOIN {name} b ON h.j = b.j"))
            return
        if op == "softmax" and ins[0] in self.form and node.attrs["dim"] in (-1, ins[0].type.rank - 1):
            rel = self._long(ins[0])
            shifted = self.cte(f"SELECT key, j, exp(v - max(v) OVER (PARTITION BY key)) AS e FROM {rel}")
            self.form[node.outputs[0]] = ("long", self.cte(
                f"SELECT key, j, e / sum(e) OVER (PARTITION BY key) AS v FROM {shifted}"))
            return
        raise KilnError(f"to_sql: cannot lower {node.op_name} ({', '.join(str(v.type) for v in ins)}) at "
                        f"{node.loc or '%' + node.outputs[0].name}; to_sql lowers linear layers, bias adds, "
                        "relu and a last-axis softmax")

    def _long(self, value: Value) -> str:
        kind, rel = self.form[value]
        if kind == "long":
            return rel
        return self.cte(f"SELECT key, i - 1 AS j, v[i] AS v FROM {rel}, range(1, len(v) + 1) r(i)")

    def _bias_of(self, node: Any) -> tuple[np.ndarray, Value] | None:
        """The bias param added to ``node``'s only use, and that add's result."""
        out = node.outputs[0]
        users = self.users.get(out, [])
        if len(users) != 1:
            return None
        add = users[0]
        if add.op_name != "add":
            return None
        other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
        if other.origin != "param" or other.type.rank != 1:
            return None
        return self.params[other.name], add.outputs[0]


def _weight_relation(weight: np.ndarray, bias: tuple[np.ndarray, Value] | None) -> Any:
    import pyarrow as pa

    m, n = weight.shape
    b = bias[0] if bias is not None else np.zeros(m, np.float32)
    rows = pa.FixedSizeListArray.from_arrays(pa.array(weight.astype(np.float32).reshape(-1)), n)
    return pa.table({"j": pa.array(np.arange(m, dtype=np.int32)), "w": rows, "b": pa.array(b.astype(np.float32))})


def _bias_relation(bias: np.ndarray) -> Any:
    import pyarrow as pa

    return pa.table({"j": pa.array(np.arange(len(bias), dtype=np.int32)), "b": pa.array(bias.astype(np.float32))})


def _param_values(graph: Graph, params: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    out = {}
    for v in graph.params:
        if v.name not in params:
            raise KilnError(f"to_sql: no value for param %{v.name}; give params= a mapping from the graph's "
                            f"param names ({', '.join(p.name for p in graph.params)}) to tensors")
        out[v.name] = params[v.name].detach().float().numpy()
    return out


__all__ = ["SqlPlan", "duckdb_udf", "to_sql"]
