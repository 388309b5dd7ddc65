"""Serving inside DuckDB: a kiln-compiled MLP as an arrow UDF, and the MLP lowered to SQL.

Tables have 5,000 rows, so DuckDB calls the UDF with several batches (of up to 2,048 rows,
the last one shorter); results are compared with eager after ``ORDER BY``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import kiln
from kiln.export import duckdb_udf, to_sql

duckdb = pytest.importorskip("duckdb")
pa = pytest.importorskip("pyarrow")

ROWS = 5000


def _mlp(softmax: bool = True) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)]
    return nn.Sequential(*layers, *([nn.Softmax(-1)] if softmax else [])).eval()


@pytest.fixture
def features():
    """A connection with table ``feats(id, v FLOAT[8], x1..x8)`` and the features as a tensor."""
    x = torch.randn(ROWS, 8, generator=torch.Generator().manual_seed(1))
    con = duckdb.connect()
    columns = {"id": pa.array(np.arange(ROWS, dtype=np.int64)),
               "v": pa.FixedSizeListArray.from_arrays(pa.array(x.numpy().reshape(-1)), 8)}
    columns.update({f"x{i + 1}": pa.array(x[:, i].numpy()) for i in range(8)})
    con.register("arrow_feats", pa.table(columns))
    con.execute("CREATE TABLE feats AS SELECT * FROM arrow_feats ORDER BY random()")  # rows out of order
    yield con, x
    con.close()


def _rows(con, query: str, column: int = 1) -> np.ndarray:
    return np.array([row[column] for row in con.execute(query).fetchall()], dtype=np.float32)


def _calls(monkeypatch, compiled) -> list[int]:
    sizes: list[int] = []
    original = type(compiled).__call__

    def counting(self, *args, **kwargs):
        sizes.append(int(args[0].shape[0]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(compiled), "__call__", counting)
    return sizes


def test_a_static_batch_model_serves_every_batch_as_padded_chunks(features, monkeypatch):
    con, x = features
    model = _mlp()
    compiled = kiln.compile(model, (torch.randn(512, 8),), backend="cpu", cache=False, strict=True)
    duckdb_udf(compiled, con, "mlp")
    sizes = _calls(monkeypatch, compiled)
    got = _rows(con, "SELECT id, mlp(v) FROM feats ORDER BY id")
    with torch.no_grad():
        want = model(x).numpy()
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5
    assert set(sizes) == {512} and len(sizes) >= 10, sizes  # 5,000 rows in batches of <= 2,048, chunks of 512


def test_a_dynamic_batch_model_over_feature_columns(features, monkeypatch):
    con, x = features
    model = _mlp(softmax=False)[:3]  # 8 -> 32 -> relu -> 16
    batch = torch.export.Dim("batch", min=2, max=1024)
    compiled = kiln.compile(model, (torch.randn(64, 8),), backend="cpu", cache=False, strict=True,
                            dynamic_shapes=({0: batch},))
    duckdb_udf(compiled, con, "features16", columns=True)
    sizes = _calls(monkeypatch, compiled)
    got = _rows(con, "SELECT id, features16(x1, x2, x3, x4, x5, x6, x7, x8) FROM feats ORDER BY id")
    with torch.no_grad():
        want = model(x).numpy()
    assert np.abs(got - want).max() <= 1e-5
    assert max(sizes) == 1024 and min(sizes) < 1024 and sum(sizes) >= ROWS, sizes


def test_a_scalar_output_becomes_a_float_column(features):
    con, x = features
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 1), nn.Flatten(0)).eval()
    duckdb_udf(kiln.compile(model, (torch.randn(256, 8),), backend="cpu", cache=False), con, "score")
    got = _rows(con, "SELECT id, score(v) FROM feats ORDER BY id")
    with torch.no_grad():
        assert np.abs(got - model(x).numpy()).max() <= 1e-5


@pytest.mark.parametrize("softmax", [True, False], ids=["softmax", "logits"])
def test_the_sql_plan_matches_kiln(features, softmax):
    con, x = features
    model = _mlp(softmax)
    plan = to_sql(model, (torch.randn(4, 8),), table="feats")
    plan.install(con)
    assert "array_inner_product" in plan.query and "GREATEST" in plan.query
    assert ("PARTITION BY key" in plan.query) == softmax
    got = _rows(con, plan.query + " ORDER BY id")
    with torch.no_grad():
        want = kiln.compile(model, (x,), backend="cpu", cache=False)(x).numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))


def test_unsupported_models_are_refused_with_the_op():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh())
    with pytest.raises(kiln.KilnError, match=r"to_sql: cannot lower tanh .*relu and a last-axis softmax"):
        to_sql(model, (torch.randn(4, 8),), table="t")
    two_inputs = kiln.compile(lambda a, b: a + b, (torch.randn(4, 8), torch.randn(4, 8)), backend="reference")
    with pytest.raises(kiln.KilnError, match=r"one \[batch, n\] tensor"):
        duckdb_udf(two_inputs, duckdb.connect(), "f")
