"""Model fingerprints: a key for a captured program, computed without tracing the model.

:func:`model_fingerprint` hashes what decides the program ``torch.export`` records for a
module called on example inputs:

* for every module in ``model.modules()``: its path, its class's qualified name, the
  hash of the source file of every class in its MRO (classes from torch are identified by
  the torch version instead) and the installed version of the package they come from; the
  closure cells, defaults and plain global values (numbers, strings, tuples, tensors)
  that those classes' methods refer to; its ``training`` flag and its other attributes
  (config objects, numbers, strings, tuples, dtypes, functions ...), described
  recursively;
* every parameter and buffer: name, shape, dtype, device, ``requires_grad``, persistence,
  and which names share one tensor (tied weights) -- never the values, which kiln reads
  live at every call; tensors that are plain attributes (constants) by their contents;
* the example inputs' pytree structure, the tensors' shapes, dtypes, devices and
  ``requires_grad``, and non-tensor inputs by value;
* torch's version, Python's, kiln's sources (:func:`kiln_source_identity`), the default
  dtype and the grad mode.

Assumption (the capture cache depends on it): a forward whose trace depends on anything
else -- global state outside its modules' attributes, the classes' source files and the
referenced plain globals, e.g. a helper function in another edited but not reinstalled
file, an environment variable, a global flag read through a function -- may be served a
stale program.  Turn the capture cache off with ``cache=False`` or ``KILN_CAPTURE_CACHE=0``.

Models the fingerprint cannot describe safely -- forward or backward hooks, modules or
objects outside ``model.modules()`` reached from attributes, objects known only by their
address -- get ``None``: they are always traced.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib.metadata
import inspect
import os
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

FINGERPRINT_VERSION = 1
_MAX_DEPTH = 40  # decorator chains nest functions in closures
_MAX_TENSOR_BYTES = 64 << 20
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_VOLATILE_ATTRIBUTES = frozenset({
    "_original_object_hash",  # transformers' GenerationConfig: hash(), differs per process
})
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


class Uncacheable(Exception):
    """Raised while describing a model that cannot be fingerprinted safely."""


# ----------------------------------------------------------------- identities
@functools.lru_cache(maxsize=1)
def kiln_source_identity() -> str:
    """kiln's version plus a hash of the sources that decide captured and optimized graphs
    (``kiln/ir``, ``kiln/compiler``, ``kiln/passes``)."""
    import kiln

    root = Path(kiln.__file__).parent
    h = hashlib.sha256()
    for package in ("ir", "compiler", "passes"):
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return f"kiln {kiln.__version__} {h.hexdigest()[:24]}"


_FILE_HASHES: dict[str, tuple[int, int, str]] = {}


def file_hash(path: str | None) -> str:
    """sha256 (16 hex) of a source file, memoized by modification time and size."""
    if not path:
        raise Uncacheable("a class or function has no source file")
    try:
        stat = os.stat(path)
    except OSError as e:
        raise Uncacheable(f"source file {path} cannot be read ({e})") from None
    known = _FILE_HASHES.get(path)
    if known is not None and known[:2] == (stat.st_mtime_ns, stat.st_size):
        return known[2]
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    _FILE_HASHES[path] = (stat.st_mtime_ns, stat.st_size, digest)
    return digest


@functools.lru_cache(maxsize=256)
def package_version(top_level: str) -> str:
    """The installed version of a top-level package ('' when it has none)."""
    module = sys.modules.get(top_level)
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(top_level)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return ""


def _is_torch(module_name: str) -> bool:
    return module_name == "torch" or module_name.startswith("torch.")


# ----------------------------------------------------------------- describing values
class _Describer:
    """Turns model state into stable text; raises :class:`Uncacheable` when it cannot."""

    def __init__(self, tree_modules: set[int]):
        self.tree_modules = tree_modules
        self.seen: dict[tuple[int, bool], str] = {}
        self.classes: dict[type, str] = {}
        self.active: set[tuple[int, bool]] = set()
        self.keep: list[Any] = []  # described objects stay alive, so their ids stay unique
        self.lenient = False  # inside a class's own functions: opaque objects by type only

    def value(self, v: Any, depth: int = 0) -> str:
        if depth > _MAX_DEPTH:
            raise Uncacheable("an attribute is nested too deeply to describe")
        if isinstance(v, _PLAIN):
            return f"{type(v).__name__}:{v!r}"
        if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return repr(v)
        if isinstance(v, enum.Enum):
            return f"{type(v).__module__}.{type(v).__qualname__}.{v.name}"
        if isinstance(v, torch.nn.Module):
            if id(v) in self.tree_modules:
                return f"module {type(v).__qualname__}"
            raise Uncacheable(f"an attribute holds a {type(v).__name__} module outside model.modules()")
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, np.ndarray):
            return f"ndarray {v.dtype} {v.shape} {hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()[:16]}"
        if isinstance(v, np.generic):
            return f"{type(v).__name__}:{v!r}"
        if isinstance(v, type):
            return self.cls(v)
        if isinstance(v, types.ModuleType):
            return f"pymodule {v.__name__}"
        return self.memoized(v, depth)

    def memoized(self, v: Any, depth: int) -> str:
        """Functions, containers and objects, each described once per fingerprint."""
        key = (id(v), self.lenient)
        if key in self.active:
            return "<cycle>"
        if key in self.seen:
            return self.seen[key]
        self.active.add(key)
        try:
            if isinstance(v, (types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                              functools.partial)) or (callable(v) and hasattr(v, "__code__")):
                text = self.function(v, depth)
            else:
                text = self._describe_compound(v, depth)
        finally:
            self.active.discard(key)
        self.seen[key] = text = _short(text)
        self.keep.append(v)
        return text

    def _describe_compound(self, v: Any, depth: int) -> str:
        kind = f"{type(v).__module__}.{type(v).__qualname__}"
        if isinstance(v, (tuple, list)):
            return f"{kind}[" + ", ".join(self.value(x, depth + 1) for x in v) + "]"
        if isinstance(v, (set, frozenset)):
            return f"{kind}{{" + ", ".join(sorted(self.value(x, depth + 1) for x in v)) + "}"
        if isinstance(v, Mapping):
            items = sorted((self.value(k, depth + 1), self.value(x, depth + 1)) for k, x in v.items())
            return f"{kind}{{" + ", ".join(f"{k}: {x}" for k, x in items) + "}"
        state = getattr(v, "__dict__", None)
        if isinstance(state, dict):
            state = {k: x for k, x in state.items() if k not in _VOLATILE_ATTRIBUTES}
            return f"{self.cls(type(v))} " + self._describe_compound(state, depth + 1)
        text = repr(v)
        if " at 0x" not in text:
            return f"{kind} {text}"
        if self.lenient:  # e.g. a decorator's state, fixed when its (hashed) source was imported
            return f"{kind} <opaque>"
        raise Uncacheable(f"an attribute of type {kind} is known only by its address")

    def tensor(self, t: torch.Tensor) -> str:
        head = f"tensor {type(t).__name__} {tuple(t.shape)} {t.dtype} {t.device} {t.requires_grad}"
        if t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor):
            raise Uncacheable("a tensor attribute has no data")
        size = t.numel() * t.element_size()
        if size > _MAX_TENSOR_BYTES:
            raise Uncacheable(f"a tensor attribute of {size} bytes is too large to hash")
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return f"{head} {hashlib.sha256(data).hexdigest()[:16]}"

    def cls(self, c: type) -> str:
        """A class's identity: name, source-file hashes of its MRO, package versions, and
        the closures, defaults and plain globals of its own functions."""
        known = self.classes.get(c)
        if known is not None:
            return known
        self.classes[c] = f"class {c.__module__}.{c.__qualname__}"  # cuts recursion through globals
        parts = []
        for base in c.__mro__:
            if base is object or _is_torch(base.__module__):
                parts.append(f"{base.__module__}.{base.__qualname__}")
                continue
            source = inspect.getsourcefile(base) if base.__module__ in sys.modules else None
            parts.append(f"{base.__module__}.{base.__qualname__}@{file_hash(source)}"
                         f"/{package_version(base.__module__.partition('.')[0])}")
            for name, member in sorted(vars(base).items()):
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if isinstance(member, property):
                    member = member.fget
                if isinstance(member, types.FunctionType):
                    parts.append(f"{name}: {self._lenient_function_state(member)}")
                elif isinstance(member, _PLAIN) and not name.startswith("__"):
                    parts.append(f"{name}={self.value(member)}")
        text = _short(f"class {c.__module__}.{c.__qualname__} (" + "; ".join(parts) + ")")
        self.classes[c] = text
        return text

    def _lenient_function_state(self, fn: types.FunctionType) -> str:
        lenient, self.lenient = self.lenient, True
        try:
            return self._function_state(fn, 1)
        finally:
            self.lenient = lenient

    def function(self, fn: Any, depth: int) -> str:
        if isinstance(fn, functools.partial):
            return (f"partial {self.value(fn.func, depth + 1)} {self.value(fn.args, depth + 1)} "
                    f"{self.value(fn.keywords, depth + 1)}")
        if isinstance(fn, types.MethodType):
            owner = fn.__self__
            bound = f"module {type(owner).__qualname__}" if id(owner) in self.tree_modules \
                else self.value(owner, depth + 1)
            return f"method of {bound}: {self.function(fn.__func__, depth + 1)}"
        name = f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', type(fn).__name__)}"
        code = getattr(fn, "__code__", None)
        if code is None:
            return f"builtin {name}"
        module = getattr(fn, "__module__", None) or ""
        if _is_torch(module):
            return f"fn {name}"
        if not isinstance(fn, types.FunctionType):
            return f"callable {name} code={_code_digest(code)}"
        return f"fn {name}@{file_hash(code.co_filename)} {self._function_state(fn, depth)}"

    def _function_state(self, fn: types.FunctionType, depth: int) -> str:
        """Its code, closure cells, defaults and the plain globals the code names."""
        cells = [self.value(c.cell_contents, depth + 1) if _cell_filled(c) else "<empty>"
                 for c in fn.__closure__ or ()]
        parts = [f"code={_code_digest(fn.__code__)}", f"closure={cells}",
                 f"defaults={self.value(fn.__defaults__, depth + 1)}",
                 f"kwdefaults={self.value(fn.__kwdefaults__, depth + 1)}"]
        scope = fn.__globals__
        for name in sorted(_global_names(fn.__code__)):
            if name not in scope:
                continue
            value = scope[name]
            if isinstance(value, (*_PLAIN, torch.Tensor)) or (
                    isinstance(value, tuple) and all(isinstance(x, _PLAIN) for x in value)):
                parts.append(f"{name}={self.value(value, depth + 1)}")
        return " ".join(parts)


def _short(text: str) -> str:
    """Long descriptions by digest, so a fingerprint's text stays small."""
    if len(text) <= 256:
        return text
    return f"{text[:64]}...#{hashlib.sha256(text.encode()).hexdigest()[:24]}"


def _cell_filled(cell: Any) -> bool:
    try:
        return cell.cell_contents is not _MISSING_CELL
    except ValueError:  # a cell not assigned yet
        return False


_MISSING_CELL = object()


@functools.lru_cache(maxsize=4096)
def _code_digest(code: types.CodeType) -> str:
    """A digest of what a code object does (two lambdas on one source line differ)."""
    consts = [_const_text(c) for c in code.co_consts]
    text = repr((code.co_firstlineno, code.co_code.hex(), consts, code.co_names, code.co_varnames,
                 code.co_freevars))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _const_text(c: Any) -> str:
    if isinstance(c, types.CodeType):
        return _code_digest(c)
    if isinstance(c, (tuple, frozenset)):
        items = [_const_text(x) for x in c]
        return f"{type(c).__name__}{sorted(items) if isinstance(c, frozenset) else items}"
    return f"{type(c).__name__}:{c!r}"


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> frozenset[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return frozenset(names)


# ----------------------------------------------------------------- the fingerprint
def _module_lines(model: torch.nn.Module, describe: _Describer) -> list[str]:
    lines = []
    owners: dict[int, str] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if any(getattr(module, name, None) for name in _HOOK_DICTS):
            raise Uncacheable(f"module '{path}' has hooks")
        state = {k: v for k, v in vars(module).items() if k not in _MODULE_INTERNALS}
        lines.append(f"module {path!r}: {describe.cls(type(module))} training={module.training} "
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


def _input_lines(args: tuple[Any, ...], kwargs: Mapping[str, Any], describe: _Describer) -> list[str]:
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    lines = [f"inputs {spec}"]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            lines.append(f"  input tensor {type(leaf).__name__} {tuple(leaf.shape)} {leaf.dtype} "
                         f"{leaf.device} grad={leaf.requires_grad}")
        else:
            lines.append(f"  input {describe.value(leaf)}")
    return lines


def model_fingerprint(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None,
                      *, extra: str = "") -> str | None:
    """The sha256 hex key of (model, example inputs) -- see the module docstring -- or
    ``None`` when the model cannot be fingerprinted safely.  ``extra`` is hashed too."""
    module_hooks = torch.nn.modules.module
    if any(getattr(module_hooks, name, None) for name in _GLOBAL_HOOKS):
        return None
    tree = {id(m) for m in model.modules()}
    describe = _Describer(tree)
    try:
        lines = [f"kiln-fingerprint {FINGERPRINT_VERSION}", kiln_source_identity(),
                 f"torch {torch.__version__} python {sys.version_info[:3]}",
                 f"default-dtype {torch.get_default_dtype()} grad {torch.is_grad_enabled()}", extra]
        lines += _module_lines(model, describe)
        lines += _input_lines(args, kwargs or {}, describe)
    except (Uncacheable, TypeError, OSError, RecursionError):
        return None
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


__all__ = ["FINGERPRINT_VERSION", "Uncacheable", "file_hash", "kiln_source_identity", "model_fingerprint",
           "package_version"]
