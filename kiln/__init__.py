"""kiln: a deep-learning compiler for PyTorch models.

::

    fast = kiln.compile(model, (x,))              # inference module; same call, same outputs
    graph = kiln.capture(model, (x,))             # the kiln graph IR (strict)
    opt = torch.compile(model, backend="kiln")    # kiln as a torch.compile backend
    step = kiln.compile_train(model, loss_fn, optimizer, (x, y))  # a whole training step

Importing kiln imports torch but neither ``torch._dynamo`` nor ``transformers``; the
``"kiln"`` torch.compile backend is registered when Dynamo is first imported.
"""

__version__ = "0.1.0"

from kiln.ir import KilnError
from kiln.ir.errors import IllegalTransformError, ScheduleError
from kiln.compiler.api import capture, compile
from kiln.compiler.train import compile_train
from kiln.frontends.errors import UnsupportedOpError
from kiln.frontends.torch.fallback import KilnFallbackWarning
from kiln.frontends.torch.dynamo import install_registration as _install_registration

_install_registration()


def __getattr__(name: str):
    # kiln.loops (and its Schedule) load islpy: imported on first use, not with kiln.
    if name in ("loops", "Schedule"):
        import importlib

        loops = importlib.import_module("kiln.loops")
        return loops if name == "loops" else loops.Schedule
    if name in ("schedule", "train"):  # kiln.schedule (model-level schedules), kiln.train (training loops)
        import importlib

        return importlib.import_module("kiln." + name)
    if name == "jax":  # kiln.jax loads jax on first use
        import importlib

        return importlib.import_module("kiln.jax")
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")

__all__ = ["IllegalTransformError", "KilnError", "KilnFallbackWarning", "Schedule", "ScheduleError",
           "UnsupportedOpError", "__version__", "capture", "compile", "compile_train", "jax", "loops", "schedule",
           "train"]
