"""The JAX frontend: jaxprs to kiln graphs.

* :mod:`.lowering` -- :func:`capture_jaxpr` (a ``ClosedJaxpr`` to a kiln graph) and the
  equation-by-equation lowering under it;
* :mod:`.rules` -- the primitive table (:func:`~.rules.lowers`), the context rules build
  with, the supported JAX versions and the import-time check of primitive names;
* one module per primitive family: :mod:`.prim_math`, :mod:`.prim_layout`, :mod:`.prim_indexing`,
  :mod:`.prim_contract`, :mod:`.prim_reduce`, :mod:`.prim_control`;
* :mod:`.arrays` -- arrays across the JAX <-> kiln boundary (DLPack, no copies);
* :mod:`.errors` -- :class:`UnsupportedPrimitiveError`.

The user-facing API over it is :mod:`kiln.jax` (``jit``, ``grad``, ``value_and_grad``).
Importing this package imports JAX and checks its version and primitive names.
"""

from .rules import check_jax_version, check_primitive_names, PRIMITIVE_TABLE, SUPPORTED_JAX

check_jax_version()

from . import prim_contract, prim_control, prim_indexing, prim_layout, prim_math, prim_reduce  # noqa: E402,F401
from .errors import UnsupportedPrimitiveError  # noqa: E402
from .lowering import capture_jaxpr, source_location  # noqa: E402

check_primitive_names()

__all__ = ["PRIMITIVE_TABLE", "SUPPORTED_JAX", "UnsupportedPrimitiveError", "capture_jaxpr",
           "source_location"]
