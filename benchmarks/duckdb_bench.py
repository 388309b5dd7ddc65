"""Serving an MLP on a DuckDB table three ways: ``python -m benchmarks.duckdb_bench``.

A table of ``--rows`` feature vectors (``FLOAT[64]``) is scored by an MLP (64 -> 128 -> 64
-> 10, ReLU, softmax), and each path produces ``(id, probabilities)`` for every row:

* ``eager-pull``: the rows pulled out of DuckDB (an arrow fetch), the model run by PyTorch
  eager on the whole tensor, the result kept in Python;
* ``kiln-udf``: ``SELECT id, mlp(v) FROM t`` with the model compiled by kiln (cpu backend,
  batch 2,048) registered as an arrow UDF (:func:`kiln.export.duckdb_udf`);
* ``sql``: the relation-centric plan of :func:`kiln.export.to_sql`, run by DuckDB alone.

Each path runs ``--repeat`` times, the three interleaved round by round, and the median
wall time is reported with the max error against eager.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from torch import nn


def build(rows: int, seed: int = 0):
    import duckdb
    import pyarrow as pa

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10),
                          nn.Softmax(-1)).eval()
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed + 1))
    con = duckdb.connect()
    con.register("features_arrow", pa.table({"id": pa.array(np.arange(rows, dtype=np.int64)),
                                             "v": pa.FixedSizeListArray.from_arrays(pa.array(x.numpy().reshape(-1)), 64)}))
    con.execute("CREATE TABLE features AS SELECT * FROM features_arrow")
    con.unregister("features_arrow")
    return model, x, con


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.duckdb_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    import kiln
    from kiln.export import duckdb_udf, to_sql
    from kiln.runtime.timing import best_time

    model, x, con = build(args.rows)
    compiled = kiln.compile(model, (torch.randn(2048, 64),), backend="cpu")
    duckdb_udf(compiled, con, "mlp")
    plan = to_sql(model, (torch.randn(4, 64),), table="features")
    plan.install(con)
    with torch.no_grad():
        want = model(x).numpy()

    def eager_pull():
        table = con.sql("SELECT id, v FROM features ORDER BY id").to_arrow_table()
        rows = table.column("v").combine_chunks().flatten().to_numpy().reshape(-1, 64)
        with torch.no_grad():
            return model(torch.from_numpy(rows.copy())).numpy()

    def udf():
        table = con.sql("SELECT id, mlp(v) AS p FROM features ORDER BY id").to_arrow_table()
        return table.column("p").combine_chunks().flatten().to_numpy().reshape(-1, 10)

    def sql():
        table = con.sql(plan.query + " ORDER BY id").to_arrow_table()
        return table.column("v").combine_chunks().flatten().to_numpy().reshape(-1, 10)

    paths = {"eager-pull": eager_pull, "kiln-udf": udf, "sql": sql}
    times: dict[str, list[float]] = {name: [] for name in paths}
    errors = {name: float(np.abs(fn() - want).max()) for name, fn in paths.items()}  # also warms up
    for _ in range(args.repeat):
        for name, fn in paths.items():  # one timed call per path per round: the paths interleave
            times[name].append(best_time(fn, repeat=1, warmup=0))
    print(f"{args.rows} rows, MLP 64-128-64-10 with softmax, {torch.get_num_threads()} threads, "
          f"median of {args.repeat} interleaved rounds")
    print("| path | median s | rows/s | max abs err vs eager |")
    print("|---|---|---|---|")
    for name in paths:
        median = statistics.median(times[name])
        print(f"| {name} | {median:.3f} | {args.rows / median:,.0f} | {errors[name]:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
