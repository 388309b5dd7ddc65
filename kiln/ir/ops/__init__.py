"""Built-in op declarations. Importing this package registers every op.

One module per family; each op is declared once with :func:`kiln.ir.registry.defop`.
"""

from . import (  # noqa: F401
    attention,
    conv,
    creation,
    distributions,
    custom,
    elementwise,
    embedding,
    fused,
    indexing,
    layout,
    linalg,
    norm,
    pool,
    random,
    reduction,
    sorting,
    special,
)
