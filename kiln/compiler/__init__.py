"""The driver: kiln's public API, the training driver, the command line and the demo.

* :mod:`.api` -- ``kiln.compile`` and ``kiln.capture``;
* :mod:`.train` -- ``kiln.compile_train``, a whole training step as one graph;
* :mod:`.cli` -- ``kiln`` on the command line; :mod:`.demo` -- ``python -m kiln``.

The frontends it drives are in :mod:`kiln.frontends` (PyTorch: :mod:`kiln.frontends.torch`,
whose :mod:`~kiln.frontends.torch.dynamo` is the ``"kiln"`` backend of ``torch.compile``).
The public entry points are re-exported by :mod:`kiln`.
"""

from .api import compile
from kiln.frontends.errors import UnsupportedOpError
from kiln.frontends.torch.fallback import KilnFallbackWarning

__all__ = ["KilnFallbackWarning", "UnsupportedOpError", "compile"]
