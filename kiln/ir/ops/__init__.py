"""Built-in op declarations. Importing this package registers every op.

One module per family; each op is declared once with :func:`kiln.ir.registry.defop`.
"""

from . import (  # noqa: F401
    attention,
    conv,
    creation,
    elementwise,
    embedding,
    fused,
    layout,
    linalg,
    norm,
    pool,
    reduction,
)
