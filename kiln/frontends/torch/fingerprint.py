"""Model fingerprints: a key for a captured program, computed without tracing the model.

:func:`model_fingerprint` hashes what decides the program ``torch.export`` records for a
module called on example inputs -- everything the program's code can read:

* for every module in ``model.modules()``: its path, its class (a namespace, below), its
  ``training`` flag and its other attributes, described recursively;
* every parameter and buffer: name, shape, dtype, device, ``requires_grad``, persistence,
  and which names share one tensor (tied weights) -- never the values, which kiln reads
  live at every call; tensors anywhere else (attributes, globals, closures) by content;
* every Python function reached (``forward`` stored on a module, methods, closures,
  defaults, globals, a bound method's ``__func__``, a ``functools.partial``'s function):
  its qualified name, source file hash and bytecode digest, its closure cells, defaults,
  ``__dict__``, the value of every global its code (and nested code) loads, builtins
  included, and the modules it imports -- each value described the same way, so a global
  function's own globals are covered, recursively;
* classes and Python modules as *namespaces*: a class by its MRO's source file hashes and
  package versions, and both by every member whose name some reached code reads as an
  attribute (``co_names``, plus ``forward`` and the dunders Python calls implicitly), in
  every class of the MRO (:meth:`.describe.Describer.settle` repeats until no new name
  turns up);
* the example inputs' pytree structure, the tensors' shapes, dtypes, devices and
  ``requires_grad``, and non-tensor inputs by value;
* torch's version, Python's, kiln's sources (:func:`kiln_source_identity`), the default
  dtype and the grad mode.

The description itself is :class:`.describe.Describer`'s.  Functions and classes of torch
and of the standard library are identified by qualified name (their versions are in the
key); functions of installed packages (``site-packages``,
with a version) by name, file hash, version, code, closure and the plain values among the
globals they load -- their further reads are not followed.  Loggers, locks, sentinels
(``object()``) and context variables (by current value) are described by what they are.

Anything else the description cannot pin down -- forward or backward hooks, modules
outside ``model.modules()``, objects known only by their address, a program reaching more
functions or nesting deeper than the limits of :mod:`.describe` -- makes the model
uncacheable: :func:`model_fingerprint` gives ``None`` (always traced) and
:func:`uncacheable_reason` says why.  Not seen: torch's and the standard library's own
module state and installed packages' non-plain module globals.  Turn the capture cache
off with ``cache=False`` / ``capture_cache=False`` or ``KILN_CAPTURE_CACHE=0``.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .describe import Describer, Uncacheable, file_hash, package_version

FINGERPRINT_VERSION = 2
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
_KILN_ROOT = Path(__file__).resolve().parents[2]
_GRAPH_SOURCES = ("ir", "passes", "frontends", "compiler")
"""The packages whose code decides captured and optimized graphs (the ATen rules, capture,
the passes, the pipeline the API asks for)."""


# ----------------------------------------------------------------- identities
@functools.lru_cache(maxsize=1)
def kiln_source_identity() -> str:
    """A hash of kiln's sources that decide captured and optimized graphs: ``kiln/__init__.py``
    (which holds the version) and ``kiln/ir``, ``kiln/passes``, ``kiln/frontends`` and
    ``kiln/compiler``, read from the files (nothing is imported)."""
    h = hashlib.sha256()
    paths = [_KILN_ROOT / "__init__.py"]
    for package in _GRAPH_SOURCES:
        paths += sorted((_KILN_ROOT / package).rglob("*.py"))
    for path in paths:
        h.update(str(path.relative_to(_KILN_ROOT)).encode())
        h.update(path.read_bytes())
    return f"kiln sources {h.hexdigest()[:24]}"


# ----------------------------------------------------------------- the fingerprint
def _module_lines(model: torch.nn.Module, describe: Describer) -> list[str]:
    lines = []
    owners: dict[int, str] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if any(getattr(module, name, None) for name in _HOOK_DICTS):
            raise Uncacheable(f"module '{path}' has hooks")
        state = {k: v for k, v in vars(module).items() if k not in _MODULE_INTERNALS}
        lines.append(f"module {path!r}: {describe.namespace(type(module))} training={module.training} "
                     f"attrs={describe.value(state)}")
        non_persistent = module._non_persistent_buffers_set
        for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
            for name, t in tensors.items():
                if t is None:
                    lines.append(f"  {kind} {name}: None")
                    continue
                full = f"{path}.{name}" if path else name
                first = owners.setdefault(id(t), full)
                persistent = "" if kind == "param" or name not in non_persistent else " non-persistent"
                lines.append(f"  {kind} {name}: {tuple(t.shape)} {t.dtype} {t.device} "
                             f"grad={t.requires_grad}{persistent} same-as={first}")
    return lines


def _input_lines(args: tuple[Any, ...], kwargs: Mapping[str, Any], describe: Describer) -> list[str]:
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    lines = [f"inputs {spec}"]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            lines.append(f"  input tensor {type(leaf).__name__} {tuple(leaf.shape)} {leaf.dtype} "
                         f"{leaf.device} grad={leaf.requires_grad}")
        else:
            lines.append(f"  input {describe.value(leaf)}")
    return lines


def fingerprint_text(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None,
                     *, extra: str = "") -> str:
    """The text :func:`model_fingerprint` hashes; raises :class:`Uncacheable` saying why
    the model cannot be fingerprinted safely."""
    module_hooks = torch.nn.modules.module
    if any(getattr(module_hooks, name, None) for name in _GLOBAL_HOOKS):
        raise Uncacheable("global module hooks are registered")
    tree: dict[int, str] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        tree.setdefault(id(module), path)
    describe = Describer(tree)
    try:
        lines = [f"kiln-fingerprint {FINGERPRINT_VERSION}", kiln_source_identity(),
                 f"torch {torch.__version__} python {sys.version_info[:3]}",
                 f"default-dtype {torch.get_default_dtype()} grad {torch.is_grad_enabled()}", extra]
        lines += _module_lines(model, describe)
        lines += _input_lines(args, kwargs or {}, describe)
        describe.settle()
        lines += describe.namespace_lines()
    except (TypeError, OSError, RecursionError, AttributeError, ValueError) as e:
        raise Uncacheable(f"describing the program failed ({type(e).__name__}: {e})") from None
    return "\n".join(lines)


def model_fingerprint(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None,
                      *, extra: str = "") -> str | None:
    """The sha256 hex key of (model, example inputs) -- see the module docstring -- or
    ``None`` when the model cannot be fingerprinted safely.  ``extra`` is hashed too."""
    try:
        text = fingerprint_text(model, args, kwargs, extra=extra)
    except Uncacheable:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def uncacheable_reason(model: torch.nn.Module, args: tuple[Any, ...],
                       kwargs: Mapping[str, Any] | None = None) -> str | None:
    """Why :func:`model_fingerprint` gives ``None`` for this model (``None`` when it does not)."""
    try:
        fingerprint_text(model, args, kwargs)
    except Uncacheable as e:
        return str(e)
    return None


__all__ = ["FINGERPRINT_VERSION", "Uncacheable", "file_hash", "fingerprint_text", "kiln_source_identity",
           "model_fingerprint", "package_version", "uncacheable_reason"]
