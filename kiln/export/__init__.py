"""Serving kiln models inside a relational database (DuckDB).

* :func:`duckdb_udf` -- *UDF-centric* serving: a kiln-compiled model registered as an arrow
  user-defined function, so ``SELECT id, mlp(features) FROM t`` runs kiln's code on the
  batches DuckDB hands the function;
* :func:`to_sql` -- *relation-centric* serving: the model itself lowered to SQL (linear
  layers as inner products joined with a weight relation, ReLU as ``GREATEST``, softmax with
  window functions), so DuckDB's own engine runs it.

``duckdb`` and ``pyarrow`` are imported on first use (``pip install duckdb pyarrow``).
"""

from .sql import SqlPlan, duckdb_udf, to_sql

__all__ = ["SqlPlan", "duckdb_udf", "to_sql"]
