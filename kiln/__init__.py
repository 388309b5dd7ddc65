"""kiln: a deep-learning compiler for PyTorch models.

::

    fast = kiln.compile(model, (x,))              # inference module; same call, same outputs
    graph = kiln.capture(model, (x,))             # the kiln graph IR (strict)
    opt = torch.compile(model, backend="kiln")    # kiln as a torch.compile backend

Importing kiln imports torch but neither ``torch._dynamo`` nor ``transformers``; the
``"kiln"`` torch.compile backend is registered when Dynamo is first imported.
"""

__version__ = "0.1.0"

from kiln.ir import KilnError
from kiln.compiler.api import capture, compile
from kiln.compiler.errors import UnsupportedOpError
from kiln.compiler.fallback import KilnFallbackWarning
from kiln.compiler.dynamo import install_registration as _install_registration

_install_registration()

__all__ = ["KilnError", "KilnFallbackWarning", "UnsupportedOpError", "__version__", "capture", "compile"]
