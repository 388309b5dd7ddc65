"""Compiling a kernel module for a GPU without one: what CI can check on any machine.

:func:`compile_module` imports a module generated for a GPU (``interpret=False``), runs
each kernel's launch function with recording stand-ins for its ``@triton.jit`` functions
(so every launch's ``constexpr`` values come from the real launch code), and compiles each
recorded launch with ``triton.compile`` for a CUDA target of the given compute capability
-- all the way to a cubin, with Triton's own ``ptxas``; no driver or device is needed.
It returns, per launched function, the stages Triton produced (``ttir``, ``ttgir``,
``llir``, ``ptx``, ``cubin``).  A kernel that Triton rejects raises its compilation error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .source import TORCH_DTYPES
from .toolchain import import_kernels

_POINTER_TYPES = {
    "float64": "*fp64", "float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "int64": "*i64",
    "int32": "*i32", "int8": "*i8", "uint8": "*u8", "bool": "*i1",
}
assert set(_POINTER_TYPES) == set(TORCH_DTYPES.values())


class _Recorder:
    """Stands for a ``@triton.jit`` function: ``fn[grid](*args, **kwargs)`` records the call."""

    def __init__(self, fn: Any, calls: list):
        self.fn = fn
        self.calls = calls

    def __getitem__(self, grid: Any):
        def record(*args: Any, **kwargs: Any) -> None:
            self.calls.append((self.fn, grid, args, kwargs))
        return record


def compile_module(path: Path, capability: int = 90, configs: str = "default") -> dict[str, list[str]]:
    """Compile every kernel of the GPU module at ``path`` (module docstring).  ``configs``:
    ``"default"`` (each kernel's first configuration) or ``"all"`` (its whole space)."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415
    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    module = import_kernels(Path(path), interpret=False)
    target = GPUTarget("cuda", capability, 32)
    results: dict[str, list[str]] = {}
    for symbol, entry in module.KERNELS.items():
        pointers = [*entry["args"], *[c[:2] for c in entry["constants"]], *entry["scratch"]]
        calls: list = []
        jitted = {name: value for name, value in vars(module).items() if isinstance(value, JITFunction)
                  and not name.startswith("_")}
        try:
            for name, fn in jitted.items():
                setattr(module, name, _Recorder(fn, calls))
            for cfg in (entry["configs"][:1] if configs == "default" else entry["configs"]):
                entry["launch"]([None] * len(pointers), cfg)
        finally:
            for name, fn in jitted.items():
                setattr(module, name, fn)
        for fn, _, args, kwargs in calls:
            signature = {}
            constexprs = {}
            names = fn.arg_names
            for k, arg_name in enumerate(names):
                if k < len(args):
                    signature[arg_name] = _POINTER_TYPES[pointers[k][1]]
                elif arg_name in kwargs:
                    signature[arg_name] = "constexpr"
                    constexprs[arg_name] = kwargs[arg_name]
            options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                      target=target, options=options)
            results[f"{symbol}:{fn.__name__}:{constexprs}"] = sorted(compiled.asm)
    return results


__all__ = ["compile_module"]
