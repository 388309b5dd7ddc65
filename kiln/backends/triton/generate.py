"""One kernel's Triton source from its node: which generator, and the pointer arguments.

:func:`kernel_source` picks, for a kernel of the plan (its node, after view absorption):

1. **attention** -- a ``scaled_dot_product_attention`` node, or a fused node of views
   followed by one (absorbed strided operands): the tiled online-softmax template
   (:mod:`.attention`), from the node's attributes and its operands' element expressions;
2. otherwise the node is lowered (:func:`kiln.passes.lower.lower_node`) and the loop program
   decides: **matmul** -- one phase whose body reduces a product of two operands over the
   contraction and then runs an epilogue (:mod:`.matmul`); else the phases become
   **pointwise**, **reduction** or **general** kernels (:mod:`.rows`).

The kernel's pointer arguments are, in order: the node's distinct operands and its results
(the plan operation's ``args``), the program's constant buffers, then its scratch buffers.
Anything the generators do not handle raises (the build pipeline then falls back to the
node's reference for this kernel and lists it in ``info["fallbacks"]``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kiln.ir import Node
from kiln.ir.loops import Program
from kiln.passes.lower import lower_node

from . import configs
from .analysis import UnsupportedProgram, phases
from .attention import attention_source, is_attention
from .matmul import matmul_source, match_matmul
from .printer import ExprPrinter
from .rows import RowKernel, check_program, python_name, scratch_and_registers
from .source import PLACEHOLDER, TORCH_DTYPES, KernelSource, constant_bytes, launch_function


def kernel_source(node: Node, *, interpret: bool, tf32: bool = False, comment: str = "", symbol: str = "",
                  templates: bool = True) -> KernelSource:
    """The :class:`~.source.KernelSource` of the kernel of ``node`` (module docstring);
    ``templates=False`` uses the loop-program generators only (no attention or matmul
    template)."""
    if templates and is_attention(node):
        printer = ExprPrinter(interpret)
        source = attention_source(node, printer, tf32=tf32)
        source.symbol, source.comment = symbol, comment
        return _finish(source, printer)
    lowered = lower_node(node)
    return program_source(lowered.program, [*dict.fromkeys(lowered.inputs), *lowered.outputs], lowered.constants,
                          interpret=interpret, tf32=tf32, comment=comment, symbol=symbol, templates=templates)


def program_source(program: Program, args: list[str], constants: Mapping[str, np.ndarray] | None = None, *,
                   interpret: bool, tf32: bool = False, comment: str = "", symbol: str = "",
                   templates: bool = True) -> KernelSource:
    """The kernel of a loop program without parameters: ``args`` names its global buffers in
    pointer order (inputs, then outputs), ``constants`` gives the data of its other global
    buffers.  The matmul template when it matches (and ``templates``), else one pointwise,
    reduction or general kernel per phase."""
    printer = ExprPrinter(interpret)
    check_program(program)
    constants = dict(constants or {})
    buffers = {b.name: b for b in program.buffers}
    missing = [b.name for b in program.buffers if b.scope == "global" and b.name not in args and b.name not in constants]
    if missing:
        raise UnsupportedProgram(f"global buffer(s) {', '.join(missing)} of program '{program.name}' are neither "
                                 "arguments nor constants")
    found, scratch = phases(program)
    scratch_names = sorted(scratch)
    pointers = {name: python_name(f"{name}_ptr", "p_") for name in [*args, *constants, *scratch_names]}
    arg_specs = [(_shape(buffers[n]), TORCH_DTYPES[buffers[n].dtype]) for n in args]
    consts = [(_shape(buffers[n]), TORCH_DTYPES[buffers[n].dtype], constant_bytes(constants[n])) for n in constants]
    scratch_specs = [(_shape(buffers[n]), TORCH_DTYPES[buffers[n].dtype]) for n in scratch_names]
    match = match_matmul(program, found, scratch) if templates else None
    if match is not None:
        text, info = matmul_source(program, match, printer, pointers, tf32=tf32)
        kind = "matmul"
    else:
        registers = scratch_and_registers(program, found, scratch)
        emitter = RowKernel(program, printer, PLACEHOLDER, pointers)
        kernels = [emitter.phase(ph, registers[ph.index]) for ph in found]
        kinds = {k.kind for k in kernels}
        kind = "general" if "general" in kinds else "reduction" if "reduction" in kinds else "pointwise"
        launch = [line for k in kernels for line in k.launch]
        text = "\n\n\n".join([*(k.text for k in kernels), launch_function(launch)])
        widest = max((v for k in kernels for b, v in k.blocks.items() if b != "XBLOCK"), default=1)
        info = {"xnumel": max((k.blocks["XBLOCK"] for k in kernels), default=1), "rnumel": widest,
                "phases": len(kernels)}
    source = KernelSource(symbol, kind, text, arg_specs, consts, scratch_specs, configs.space(kind, info),
                          dict(configs.INTERPRET[kind]), comment=comment, info=info)
    return _finish(source, printer)


def _finish(source: KernelSource, printer: ExprPrinter) -> KernelSource:
    source.helpers |= printer.helpers
    return source


def _shape(buffer) -> tuple[int, ...]:
    return tuple(int(d.value) for d in buffer.shape)


__all__ = ["kernel_source", "program_source"]
