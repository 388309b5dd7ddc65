"""A learned cost model of loop schedules: gradient-boosted trees over :mod:`.features`.

The target is ``log2(default time / candidate time)`` (the speedup over the kernel's default
schedule), so kernels of very different sizes share one model; :meth:`CostModel.predict`
returns the negated predicted speedup (lower is faster), which is what the search sorts
by.  The trees are LightGBM's (``pip install lightgbm``); without it a ridge regression
over the same features (numpy only) stands in, and ``CostModel.backend`` says which.

:func:`rank_correlation` is Spearman's rho between predictions and measurements, the
figure ``docs/tuning.md`` reports on held-out kernels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def rank_correlation(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of ``a`` and ``b`` (ties get their mean rank)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"rank_correlation needs two sequences of equal length >= 2, got {len(a)} and {len(b)}")
    ra, rb = _ranks(np.asarray(a, float)), _ranks(np.asarray(b, float))
    sa, sb = ra.std(), rb.std()
    if sa == 0 or sb == 0:
        return 0.0
    return float(((ra - ra.mean()) * (rb - rb.mean())).mean() / (sa * sb))


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    for value in np.unique(x):
        same = x == value
        if same.sum() > 1:
            ranks[same] = ranks[same].mean()
    return ranks


class CostModel:
    """Predicts the speedup of a schedule over its kernel's default from its features.

    ``fit(X, y)`` with ``y`` the measured ``log2`` speedups; ``online=True`` refits on the
    measurements of a running search (:meth:`observe`, every :attr:`refit_every` new ones,
    once :attr:`min_samples` are in).
    """

    min_samples = 16
    refit_every = 8

    def __init__(self, online: bool = False, seed: int = 0, n_estimators: int = 120):
        self.online = online
        self.seed = seed
        self.n_estimators = n_estimators
        self.fitted = False
        self._model: Any = None
        self._seen = 0
        self.backend = "lightgbm" if _lightgbm() is not None else "ridge"

    def fit(self, X: Sequence[Sequence[float]], y: Sequence[float]) -> CostModel:
        X_ = np.asarray(X, float)
        y_ = np.asarray(y, float)
        if X_.ndim != 2 or len(X_) != len(y_) or len(y_) < 2:
            raise ValueError(f"CostModel.fit: need a 2-d feature matrix and one target per row, got shapes "
                             f"{X_.shape} and {y_.shape}")
        lgb = _lightgbm()
        if lgb is not None:
            params = {"objective": "regression", "learning_rate": 0.08, "num_leaves": 15, "min_data_in_leaf": 3,
                      "bagging_fraction": 0.9, "bagging_freq": 1, "seed": self.seed, "verbose": -1,
                      "num_threads": 1, "deterministic": True}
            self._model = lgb.train(params, lgb.Dataset(X_, y_, params={"verbose": -1}),
                                    num_boost_round=self.n_estimators)
        else:
            mean, std = X_.mean(0), X_.std(0) + 1e-9
            Z = (X_ - mean) / std
            w = np.linalg.solve(Z.T @ Z + np.eye(Z.shape[1]), Z.T @ (y_ - y_.mean()))
            self._model = ("ridge", mean, std, w, y_.mean())
        self.fitted = True
        return self

    def predict_speedup(self, X: Sequence[Sequence[float]]) -> np.ndarray:
        """Predicted ``log2`` speedups over the default schedule."""
        if not self.fitted:
            raise RuntimeError("CostModel: fit it first (CostModel().fit(X, y)), or use online=True in a search")
        X_ = np.asarray(X, float)
        if isinstance(self._model, tuple):
            _, mean, std, w, b = self._model
            return ((X_ - mean) / std) @ w + b
        return np.asarray(self._model.predict(X_), float)

    def predict(self, X: Sequence[Sequence[float]]) -> np.ndarray:
        """A score per row where lower means faster (the negated predicted speedup)."""
        return -self.predict_speedup(X)

    def observe(self, history: Sequence[Any], default_s: float) -> None:
        """Online mode: refit on a search's measurements (``Measured`` rows with features)."""
        rows = [m for m in history if m.features is not None and m.time_s > 0]
        if not self.online or len(rows) < self.min_samples or len(rows) - self._seen < self.refit_every:
            return
        self._seen = len(rows)
        self.fit([m.features for m in rows], [math.log2(default_s / m.time_s) for m in rows])


def _lightgbm() -> Any:
    try:
        import lightgbm  # noqa: PLC0415
    except ImportError:
        return None
    return lightgbm


__all__ = ["CostModel", "rank_correlation"]
