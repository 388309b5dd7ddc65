"""TVM's own schedules for kernels in block form: dlight defaults and MetaSchedule records.

* ``schedules="tvm"``: every block-form kernel (:func:`.tir.block_func`) gets TVM's default
  CPU schedules, ``dlight.ApplyDefaultSchedule(dlight.cpu.GEMV(), dlight.cpu.Reduction())``
  (:func:`default_schedules`); a kernel no rule matches keeps its blocks as translated.
* ``schedules="tuned"``: each kernel's schedule comes from the MetaSchedule database in
  the compile cache folder (``tvm_tuning/``, :func:`tuning_dir`), looked up by the
  structure of the kernel (:func:`tuned`); a kernel without a record gets the dlight
  defaults.  :func:`tune` fills the database: ``ms.tir_integration.tune_tir`` over the
  kernels that have no record yet, with a global trial budget (MetaSchedule needs
  ``psutil``; its XGBoost cost model is used when ``xgboost`` is installed, else random
  proposals are measured).

Workloads are keyed by structure: a kernel is normalized to ``IRModule({"main": f})`` with
``global_symbol="main"`` for tuning and for lookups alike, so equal kernels of different
graphs share records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from .compat import dlight, meta_schedule, tvm


def normalized(func):
    """``func`` as a MetaSchedule workload module."""
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main")})


def default_schedules(funcs: Mapping[str, object], target, notes: dict[str, str]) -> dict[str, object]:
    """Each function of ``funcs`` (symbol -> block-form PrimFunc) with dlight's CPU rules; a
    function a rule fails on keeps its blocks as translated (said in ``notes``)."""
    out = {}
    rules = dlight.ApplyDefaultSchedule(dlight.cpu.GEMV(), dlight.cpu.Reduction())
    for symbol, func in funcs.items():
        try:
            with target:
                module = rules(tvm.IRModule({symbol: func}))
            out[symbol] = module[symbol]
            notes.setdefault(symbol, "dlight")
        except Exception as e:  # noqa: BLE001 - TVM's schedule errors
            out[symbol] = func
            notes[symbol] = f"blocks as translated (dlight: {type(e).__name__})"
    return out


def tuning_dir(cache_directory: Path) -> Path:
    return Path(cache_directory) / "tvm_tuning"


def database(work_dir: Path):
    work_dir.mkdir(parents=True, exist_ok=True)
    return meta_schedule.database.JSONDatabase(work_dir=str(work_dir))


def tuned(func, db, target):
    """The tuned schedule of ``func`` from ``db`` (its PrimFunc), or ``None`` without a record."""
    schedule = db.query_schedule(normalized(func), target, workload_name="main")
    return None if schedule is None else schedule.mod["main"]


def cost_model() -> str:
    """MetaSchedule's XGBoost cost model when ``xgboost`` is installed, else random proposals."""
    try:
        import xgboost  # noqa: F401, PLC0415
    except ImportError:
        return "random"
    return "xgb"


def tune(funcs: Mapping[str, object], target, work_dir: Path, trials: int,
         progress: Callable[[str], None] | None = None) -> int:
    """Tune the kernels of ``funcs`` without a record in the database at ``work_dir`` with
    MetaSchedule, ``trials`` measured candidates in all; how many kernels were tuned."""
    db = database(work_dir)
    todo = {symbol: f for symbol, f in funcs.items() if tuned(f, db, target) is None}
    if not todo or trials <= 0:
        return 0
    if progress is not None:
        progress(f"MetaSchedule: {len(todo)} kernels, {trials} trials in all, records in {work_dir}")
    module = tvm.IRModule({symbol: f.with_attr("global_symbol", "main") for symbol, f in todo.items()})
    meta_schedule.tir_integration.tune_tir(module, target, str(work_dir), max_trials_global=int(trials),
                                           num_trials_per_iter=min(64, max(1, int(trials))), num_tuning_cores=1,
                                           database=db, cost_model=cost_model())
    return len(todo)


__all__ = ["database", "default_schedules", "normalized", "tune", "tuned", "tuning_dir"]
