"""TVM's modules under their 0.27 names, with the older names as fallbacks.

apache-tvm renamed much of its Python API in 2025-26: low-level TIR is ``tvm.tirx`` (was
``tvm.tir``), schedulable TIR and MetaSchedule are ``tvm.s_tir`` (was ``tvm.tir`` and
``tvm.meta_schedule``), dlight is ``tvm.s_tir.dlight`` (was ``tvm.dlight``), and
``tvm.compile`` is the build entry point (was ``tvm.build``).  The new names are probed
first.  Importing this module imports TVM; :func:`available` says whether it can.
"""

from __future__ import annotations

import importlib


def _first(*names: str):
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {', '.join(names)} can be imported")


tvm = importlib.import_module("tvm")
tirx = _first("tvm.tirx", "tvm.tir")
s_tir = _first("tvm.s_tir", "tvm.tir")
meta_schedule = _first("tvm.s_tir.meta_schedule", "tvm.meta_schedule")
dlight = _first("tvm.s_tir.dlight", "tvm.dlight")
compile_module = getattr(tvm, "compile", None) or tvm.build


def available() -> bool:
    return True


__all__ = ["available", "compile_module", "dlight", "meta_schedule", "s_tir", "tirx", "tvm"]
