"""The runtime: the compiled module and zero-copy torch <-> numpy conversion."""

from .module import CompiledModule, InputMismatchError, InputSlot
from .tensors import from_numpy, kiln_dtype, tensor_type, to_numpy, torch_dtype

__all__ = [
    "CompiledModule", "InputMismatchError", "InputSlot", "from_numpy", "kiln_dtype",
    "tensor_type", "to_numpy", "torch_dtype",
]
