"""From PyTorch to kiln: capture, fallback partitioning, the torch.compile backend, the API.

The public entry points are re-exported by :mod:`kiln`: ``kiln.compile`` and ``kiln.capture``
(:mod:`kiln.compiler.api`), and the ``"kiln"`` backend of ``torch.compile``
(:mod:`kiln.frontends.torch.dynamo`).
"""

from .api import compile
from kiln.frontends.errors import UnsupportedOpError
from kiln.frontends.torch.fallback import KilnFallbackWarning

__all__ = ["KilnFallbackWarning", "UnsupportedOpError", "compile"]
