"""GPU kernel generators: a lowered program (:class:`kiln.passes.lower.LoweredKernel`) as
kernels in kernel form (:mod:`kiln.ir.loops.gpu`), launched in order on one stream.

Entry point::

    from kiln.backends.cuda.kernels import plan_kernels, GpuPlan, GpuKernel, KernelOptions

    plan = plan_kernels(lowered, template=lowered.template, node=node, options=KernelOptions())
    plan.kernels      # GpuKernel(name, program, kind), in launch order
    plan.arguments    # the lowered program's global buffer names, in its buffers order
    plan.scratch      # zero-filled global buffers per call (the program's locals kept in memory)
    plan.constants    # the lowered kernel's tensor constants

Kinds, each chosen from the program's structure (a recognizer that does not match falls back
to ``generic``, which accepts every program):

* ``generic`` (:mod:`.generic`): one launch per top-level loop nest; the isl-proved parallel
  outer band flattened grid-stride over blocks x threads, the rest serial per thread;
* ``pointwise`` (:mod:`.pointwise`): elementwise nests, 4-wide vector loads and stores where
  sizes and alignments allow;
* ``rows`` (:mod:`.rows`): reductions and normalizations, one block (or warp) per row,
  warp shuffles and a shared-memory block reduction, the row cached in registers;
* ``matmul`` (:mod:`.matmul`): tiled, double-buffered shared-memory matmul (and batched
  matmul, and convolutions without padding as implicit GEMMs) with the fused epilogue;
  ``matmul_configs(M, N, K, batch=1, checked=False)`` lists the legal tile configurations
  (:class:`MatmulConfig`), best first; ``KernelOptions(matmul=config)`` forces one;
* ``attention`` (:mod:`.attention`): ``scaled_dot_product_attention`` nodes (optional bool
  or float mask, causal) as a tiled online softmax.  ``plan_kernels(..., node=node)`` uses it
  when ``node`` is such a node; its generator is
  ``attention_kernels(PlanContext(lowered.program, options), node, lowered.inputs,
  lowered.outputs)`` (``None`` when it does not apply).

Each kernel is ``verify_kernel``-clean and race-free (``check_races``), and its emulation
(``kiln.ir.loops.emulate.emulate``) computes what the lowered program computes.
``KernelOptions(kinds=())`` forces the generic path; ``alignment`` gives the byte alignment of
arguments that are views at odd offsets (vector accesses need ``4 x itemsize``).
"""

from .attention import attention_kernels
from .common import PlanContext
from .matmul import MatmulConfig, matmul_configs
from .plan import DEFAULT_ALIGNMENT, KINDS, GpuKernel, GpuPlan, KernelOptions, plan_kernels

__all__ = ["DEFAULT_ALIGNMENT", "KINDS", "GpuKernel", "GpuPlan", "KernelOptions", "MatmulConfig", "PlanContext",
           "attention_kernels", "matmul_configs", "plan_kernels"]
