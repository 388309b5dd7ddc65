"""Built-in op declarations. Importing this package registers every op.

One module per family (``elementwise``, ``arithmetic``, ``reduction``, ``views``, ``conv``,
...); each op is declared once with :func:`kiln.ir.registry.defop`, together with all its
rules (inference, reference, gradient, AMP policy, compute definition, decomposition,
cost).  Every module of this folder is imported, so a new family module needs no import
elsewhere.  The vocabularies the declarations use live beside them: :mod:`.vjp` (gradient
rules), :mod:`.compute` (compute definitions), :mod:`.cost` (cost rules), and the private
``_infer``/``_nn_common`` helpers.
"""

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
del _module
