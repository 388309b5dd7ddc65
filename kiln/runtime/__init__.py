"""The runtime: what runs compiled graphs.

* :mod:`.module` -- :class:`CompiledModule`, which checks inputs and runs a backend's executable;
* :mod:`.call_plan` -- the call plan backends build and the runtime runs, on the device of its
  :class:`~.call_plan.Allocator` (:data:`~.call_plan.HOST`,
  :class:`~.call_plan.TorchDeviceAllocator`), its kernels launched by a
  :class:`~.call_plan.KernelLauncher` (:class:`~.call_plan.HostLauncher`);
* :mod:`.timing` -- :func:`~.timing.best_time`, the one timing loop;
* :mod:`.cache` -- the compile cache;
* :mod:`.tensors` -- zero-copy torch <-> numpy conversion and dtype mapping.
"""

from .call_plan import HOST, Allocator, CallPlan, HostLauncher, KernelLauncher, TorchDeviceAllocator
from .module import CompiledModule, InputMismatchError, InputSlot
from .tensors import from_numpy, kiln_dtype, tensor_type, to_numpy, torch_dtype

__all__ = [
    "HOST", "Allocator", "CallPlan", "CompiledModule", "HostLauncher", "InputMismatchError", "InputSlot",
    "KernelLauncher", "TorchDeviceAllocator", "from_numpy", "kiln_dtype", "tensor_type", "to_numpy", "torch_dtype",
]
