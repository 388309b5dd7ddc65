"""Built-in op declarations. Importing this package registers every op.

One module per family; each op is declared once with :func:`kiln.ir.registry.defop`.
"""

from . import creation, elementwise, fused, layout, linalg, nn, reduction  # noqa: F401
