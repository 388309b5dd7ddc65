"""Describing a program as stable text: the engine of :mod:`kiln.frontends.torch.fingerprint`.

:class:`Describer` turns the values a program's code can read -- modules, functions,
closures, globals, classes and Python modules, tensors -- into text that is the same in
every process for the same program, or raises :class:`Uncacheable` when it cannot pin a
value down.  What it describes, and how, is listed in the fingerprint's module docstring.
Also here: the identities that text is built from (:func:`file_hash`,
:func:`package_version`, which modules count as trusted or installed) and the reading of
code objects (:func:`code_reads`).
"""

from __future__ import annotations

import contextvars
import dis
import enum
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import sys
import threading
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

_MAX_DEPTH = 64  # value nesting: calls through globals, decorator chains in closures
_MAX_FUNCTIONS = 4000  # Python functions one program may reach before it is uncacheable
_MAX_TENSOR_BYTES = 64 << 20
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_VOLATILE_ATTRIBUTES = frozenset({
    "_original_object_hash",  # transformers' GenerationConfig: hash(), differs per process
})


class Uncacheable(Exception):
    """Raised while describing a model that cannot be fingerprinted safely."""


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


def _is_trusted(module_name: str) -> bool:
    """torch's and Python's standard library's modules: their code is fixed by the versions
    in the key, so their functions and classes are identified by qualified name."""
    return _is_torch(module_name) or module_name.partition(".")[0] in _STDLIB


_STDLIB = frozenset(sys.stdlib_module_names) | {"builtins"}


@functools.lru_cache(maxsize=256)
def _installed(module_name: str) -> bool:
    """Whether the module's package is installed (in a ``site-packages`` folder, with a
    version), not code under development: then its version and file hashes stand for its
    code.  kiln itself and the user's own modules are never installed in this sense."""
    top = module_name.partition(".")[0]
    if not top or top in _STDLIB or _is_torch(top) or top == "kiln":
        return False
    module = sys.modules.get(top)
    path = getattr(module, "__file__", None) or ""
    parts = Path(path).parts
    return ("site-packages" in parts or "dist-packages" in parts) and package_version(top) != ""


# ----------------------------------------------------------------- reading code
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME",
                         "DELETE_NAME"})


@functools.lru_cache(maxsize=8192)
def code_reads(code: types.CodeType) -> tuple[frozenset[str], frozenset[str], frozenset[tuple[str, int]]]:
    """What ``code`` and the code objects nested in it can name: (global names, attribute
    names, imported modules as ``(name, level)``).  Attribute names are every name in
    ``co_names`` (a superset: global names are in it too)."""
    globals_: set[str] = set()
    attrs: set[str] = set(code.co_names)
    imports: set[tuple[str, int]] = set()
    consts: list[Any] = []
    for ins in dis.get_instructions(code):
        if ins.opname in _GLOBAL_OPS:
            globals_.add(ins.argval)
        elif ins.opname == "IMPORT_NAME":
            level = consts[-2] if len(consts) >= 2 and isinstance(consts[-2], int) else 0
            imports.add((ins.argval, level))
        consts = consts[-1:] + [ins.argval] if ins.opname == "LOAD_CONST" else []
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            g, a, i = code_reads(const)
            globals_ |= g
            attrs |= a
            imports |= i
    return frozenset(globals_), frozenset(attrs), frozenset(imports)


# ----------------------------------------------------------------- describing values
class Describer:
    """Turns a program -- modules, functions, the values they can read -- into stable text;
    raises :class:`Uncacheable` when it cannot.

    Functions and objects are described inline (once each, memoized).  Classes and Python
    modules are *namespaces*: described by a numbered label inline, and at the end
    (:meth:`settle`) by every member whose name some described code reads as an attribute
    (``co_names``, plus ``forward`` and the dunder methods Python calls implicitly), so a
    method reached through ``self.helper(...)`` or a function through ``mod.fn(...)`` is
    part of the key, in whatever class of the MRO or module it lives.
    """

    def __init__(self, tree_modules: Mapping[int, str]):
        self.tree_modules = tree_modules  # id -> path in the model
        self.seen: dict[int, str] = {}
        self.active: set[int] = set()
        self.keep: list[Any] = []  # described objects stay alive, so their ids stay unique
        self.namespaces: dict[int, str] = {}  # id -> label
        self.order: list[Any] = []
        self.members: dict[int, dict[str, str]] = {}
        self.checked: dict[int, set[str]] = {}
        self.attr_names: set[str] = set(_ALWAYS_READ)
        self.functions = 0

    # ------------------------------------------------------------- values
    def value(self, v: Any, depth: int = 0, torch_owned: bool = False, module_member: bool = False) -> str:
        if depth > _MAX_DEPTH:
            raise Uncacheable("the program nests values or calls too deeply to describe")
        if isinstance(v, _PLAIN):
            return f"{type(v).__name__}:{v!r}"
        if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return repr(v)
        if isinstance(v, enum.Enum):
            return f"{self.namespace(type(v))}.{v.name}"
        if isinstance(v, torch.nn.Module):
            if id(v) in self.tree_modules:
                return f"module {self.tree_modules[id(v)]!r}"
            raise Uncacheable(f"the program reaches a {type(v).__name__} module outside model.modules()")
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, np.ndarray):
            if v.dtype == object:
                raise Uncacheable("the program reaches a numpy array of objects")
            return f"ndarray {v.dtype} {v.shape} {hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()[:16]}"
        if isinstance(v, np.generic):
            return f"{type(v).__name__}:{v!r}"
        if isinstance(v, (type, types.ModuleType)):
            return self.namespace(v)
        if isinstance(v, logging.Logger):  # emits messages only; never decides a trace
            return f"logger {v.name}"
        if type(v) is object:  # a sentinel: compared by identity, holds nothing
            return "object()"
        if isinstance(v, _LOCKS):  # guards state; holds none of its own that a trace reads
            return f"lock {type(v).__qualname__}"
        if isinstance(v, (types.GetSetDescriptorType, types.MemberDescriptorType)):
            return f"descriptor {v.__objclass__.__qualname__}.{v.__name__}"  # the data is the instance's
        if isinstance(v, contextvars.ContextVar):
            current = v.get(_UNSET)
            return f"contextvar {v.name}=" + ("<unset>" if current is _UNSET else self.value(current, depth + 1))
        return self.memoized(v, depth, torch_owned, module_member)

    def memoized(self, v: Any, depth: int, torch_owned: bool, module_member: bool = False) -> str:
        """Functions, containers and objects, each described once per fingerprint."""
        key = id(v)
        if key in self.active:
            return "<cycle>"  # the object is being described further up: its text is in the key
        if key in self.seen:
            return self.seen[key]
        self.active.add(key)
        try:
            if isinstance(v, _FUNCTION_TYPES) or (callable(v) and hasattr(v, "__code__")):
                text = self.function(v, depth, module_member)
            else:
                text = self.compound(v, depth, torch_owned)
        finally:
            self.active.discard(key)
        self.seen[key] = text = _short(text)
        self.keep.append(v)
        return text

    def compound(self, v: Any, depth: int, torch_owned: bool) -> str:
        t = type(v)
        if _is_torch(t.__module__):
            text = repr(v)
            if " at 0x" not in text and len(text) < 512:
                return f"torch {t.__module__}.{t.__qualname__} {text}"
            if torch_owned:  # torch's own state behind a name in a torch module: torch's version
                return f"torch object {t.__module__}.{t.__qualname__}"
            state = getattr(v, "__dict__", None)
            if isinstance(state, dict):  # e.g. a torch decorator's context object in a closure
                return f"torch {t.__module__}.{t.__qualname__} state {self.compound(state, depth + 1, False)}"
            raise Uncacheable(f"the program reaches a {t.__qualname__} object known only by its address")
        kind = t.__qualname__ if t.__module__ == "builtins" else self.namespace(t)
        parts = []
        if isinstance(v, (tuple, list)):
            parts.append("[" + ", ".join(self.value(x, depth + 1) for x in v) + "]")
        elif isinstance(v, (set, frozenset)):
            parts.append("{" + ", ".join(sorted(self.value(x, depth + 1) for x in v)) + "}")
        elif isinstance(v, Mapping):
            items = sorted((self.value(k, depth + 1), self.value(x, depth + 1)) for k, x in v.items())
            parts.append("{" + ", ".join(f"{k}: {x}" for k, x in items) + "}")
        state = getattr(v, "__dict__", None)
        if isinstance(state, dict):
            state = {k: x for k, x in state.items() if k not in _VOLATILE_ATTRIBUTES}
            parts.append("state " + self.compound(state, depth + 1, False))
        slots = [name for c in t.__mro__ for name in _slot_names(c)]
        if slots:
            parts.append("slots " + ", ".join(
                f"{name}={self.value(getattr(v, name), depth + 1) if hasattr(v, name) else '<unset>'}"
                for name in slots))
        if parts:
            return f"{kind} " + " ".join(parts)
        if t.__module__ == "builtins" and t in _OPAQUE_BUILTINS:
            raise Uncacheable(f"the program reaches a {t.__qualname__} object")
        text = repr(v)
        if " at 0x" in text or t.__module__ == "builtins" and t not in _DESCRIBED_BY_REPR:
            if torch_owned:  # state of the standard library behind a module's name
                return f"{kind} <opaque>"
            raise Uncacheable(f"the program reaches a {t.__qualname__} object known only by its address")
        return f"{kind} {text}"

    def tensor(self, t: torch.Tensor) -> str:
        head = f"tensor {type(t).__name__} {tuple(t.shape)} {t.dtype} {t.device} {t.requires_grad}"
        if t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor):
            raise Uncacheable("a tensor the program reads has no data")
        size = t.numel() * t.element_size()
        if size > _MAX_TENSOR_BYTES:
            raise Uncacheable(f"a tensor of {size} bytes the program reads is too large to hash")
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return f"{head} {hashlib.sha256(data).hexdigest()[:16]}"

    # ------------------------------------------------------------- functions
    def function(self, fn: Any, depth: int, module_member: bool = False) -> str:
        if isinstance(fn, functools.partial):
            return (f"partial {self.value(fn.func, depth + 1)} {self.value(fn.args, depth + 1)} "
                    f"{self.value(fn.keywords, depth + 1)} {self.value(vars(fn), depth + 1)}")
        if isinstance(fn, types.MethodType):
            return (f"method of {self.owner(fn.__self__, depth, module_member)}: "
                    f"{self.value(fn.__func__, depth + 1)}")
        module = getattr(fn, "__module__", None) or ""
        name = f"{module}.{getattr(fn, '__qualname__', getattr(fn, '__name__', type(fn).__name__))}"
        code = getattr(fn, "__code__", None)
        if code is None:  # a builtin: its name, and the object it is bound to
            owner = getattr(fn, "__self__", None)
            if owner is None or isinstance(owner, (type, types.ModuleType)):
                return f"builtin {name}"
            return f"builtin {name} of {self.owner(owner, depth, module_member)}"
        if _is_trusted(module):
            return f"fn {name}"
        if not isinstance(fn, types.FunctionType):
            return f"callable {self.namespace(type(fn))} {name} code={_code_digest(code)}"
        if _installed(module):
            return self.installed_function(fn, name, depth)
        self.functions += 1
        if self.functions > _MAX_FUNCTIONS:
            raise Uncacheable(f"the program reaches more than {_MAX_FUNCTIONS} Python functions")
        globals_, attrs, imports = code_reads(code)
        self.attr_names |= attrs
        cells = [self.value(c.cell_contents, depth + 1) if _cell_filled(c) else "<empty>"
                 for c in fn.__closure__ or ()]
        parts = [f"fn {name}@{_source_hash(code.co_filename)}", f"code={_code_digest(code)}",
                 f"closure=[{', '.join(cells)}]", f"defaults={self.value(fn.__defaults__, depth + 1)}",
                 f"kwdefaults={self.value(fn.__kwdefaults__, depth + 1)}"]
        if fn.__dict__:
            parts.append(f"attrs={self.value(fn.__dict__, depth + 1)}")
        scope = fn.__globals__
        builtins_ = fn.__builtins__ if isinstance(fn.__builtins__, dict) else vars(fn.__builtins__)
        for gname in sorted(globals_):
            if gname in scope:
                parts.append(f"{gname}={self.value(scope[gname], depth + 1)}")
            elif gname in builtins_:
                parts.append(f"{gname}=builtins:{self.value(builtins_[gname], depth + 1)}")
            else:
                parts.append(f"{gname}=<unbound>")
        for module_name, level in sorted(imports):
            parts.append(f"import {'.' * level}{module_name}={self.imported(module_name, level, scope)}")
        return " ".join(parts)

    def installed_function(self, fn: types.FunctionType, name: str, depth: int) -> str:
        """A function of an installed package: its code is fixed by the package's version and
        file; described by those, its code, its closure and defaults (objects of installed
        or trusted types that cannot be described by their type) and the plain values and
        tensors among the globals it names.  Its own reads are not followed further."""
        code = fn.__code__
        globals_, _, _ = code_reads(code)
        top = name.partition(".")[0]
        parts = [f"installed fn {name}@{_source_hash(code.co_filename)}/{package_version(top)}",
                 f"code={_code_digest(code)}",
                 "closure=[" + ", ".join(self.tolerant(c.cell_contents, depth) if _cell_filled(c) else "<empty>"
                                         for c in fn.__closure__ or ()) + "]",
                 f"defaults={self.tolerant(fn.__defaults__, depth)}",
                 f"kwdefaults={self.tolerant(fn.__kwdefaults__, depth)}"]
        scope = fn.__globals__
        for gname in sorted(globals_):
            value = scope.get(gname)
            if isinstance(value, (*_PLAIN, torch.Tensor)) or (
                    isinstance(value, tuple) and all(isinstance(x, _PLAIN) for x in value)):
                parts.append(f"{gname}={self.value(value, depth + 1)}")
        return " ".join(parts)

    def tolerant(self, v: Any, depth: int) -> str:
        """``v`` described, or -- for an object of an installed or trusted type that cannot
        be described, e.g. a decorator's state -- its type."""
        try:
            return self.value(v, depth + 1)
        except Uncacheable:
            module = type(v).__module__
            if _installed(module) or _is_trusted(module):
                return f"<opaque {module}.{type(v).__qualname__}>"
            raise

    def owner(self, owner: Any, depth: int, module_member: bool) -> str:
        """The object a method is bound to."""
        try:
            return self.value(owner, depth + 1)
        except Uncacheable:
            if not module_member:
                raise
            # e.g. numpy.random.bytes, bound to the module's RandomState: such state decides
            # only random draws, which a trace cannot keep anyway
            return f"a {type(owner).__module__}.{type(owner).__qualname__}"

    def imported(self, name: str, level: int, scope: Mapping[str, Any]) -> str:
        if level:
            package = scope.get("__package__") or ""
            try:
                name = importlib.util.resolve_name("." * level + name, package)
            except (ImportError, ValueError):
                raise Uncacheable(f"a relative import of {name!r} cannot be resolved") from None
        labels = []
        for i, part in enumerate(name.split(".")):
            prefix = ".".join(name.split(".")[: i + 1])
            module = sys.modules.get(prefix)
            labels.append(self.namespace(module) if module is not None else f"<{prefix} not imported>")
        return ", ".join(labels)

    # ------------------------------------------------------------- namespaces
    def namespace(self, ns: type | types.ModuleType) -> str:
        """A class's or module's label; its members are described by :meth:`settle`."""
        if isinstance(ns, type):
            if _is_trusted(ns.__module__):
                return f"class {ns.__module__}.{ns.__qualname__}"  # fixed by Python's or torch's version
            kind, name = "class", f"{ns.__module__}.{ns.__qualname__}"
        else:
            kind, name = "pymodule", ns.__name__
        label = self.namespaces.get(id(ns))
        if label is None:
            label = self.namespaces[id(ns)] = f"{kind}#{len(self.order)} {name}"
            self.order.append(ns)
            self.keep.append(ns)
            self.members[id(ns)] = {}
            self.checked[id(ns)] = set()
        return label

    def settle(self) -> None:
        """Describe the namespaces' members read by name until no new name or namespace turns up."""
        progressed = True
        while progressed:
            progressed = False
            for ns in list(self.order):
                checked = self.checked[id(ns)]
                pending = sorted(self.attr_names - checked)
                if not pending:
                    continue
                progressed = True
                for name in pending:
                    checked.add(name)
                    text = self.member(ns, name)
                    if text is not None:
                        self.members[id(ns)][name] = text

    def member(self, ns: type | types.ModuleType, name: str) -> str | None:
        if isinstance(ns, types.ModuleType):
            scope = vars(ns)
            if name not in scope:
                return None
            return self.value(scope[name], 1, torch_owned=_is_trusted(ns.__name__), module_member=True)
        found = []
        for base in ns.__mro__:
            if _is_trusted(base.__module__):
                continue
            if name in vars(base):
                found.append(f"{base.__qualname__}: {self.class_member(vars(base)[name])}")
        return "; ".join(found) or None

    def class_member(self, member: Any) -> str:
        if isinstance(member, (staticmethod, classmethod)):
            return f"{type(member).__name__} {self.value(member.__func__, 1)}"
        if isinstance(member, property):
            return "property " + ", ".join(self.value(f, 1) for f in (member.fget, member.fset, member.fdel))
        if isinstance(member, functools.cached_property):
            return f"cached_property {self.value(member.func, 1)}"
        return self.value(member, 1)

    def namespace_lines(self) -> list[str]:
        lines = []
        for ns in self.order:
            head = self.namespaces[id(ns)]
            if isinstance(ns, type):
                head += " (" + "; ".join(_class_source(base) for base in ns.__mro__) + ")"
            elif getattr(ns, "__file__", None) and not _is_trusted(ns.__name__):
                head += f" @{_source_hash(ns.__file__)}"
            members = self.members[id(ns)]
            lines.append(head + "".join(f"\n  {name}: {members[name]}" for name in sorted(members)))
        return lines


_FUNCTION_TYPES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType,
                   types.WrapperDescriptorType, types.MethodWrapperType, types.MethodDescriptorType,
                   types.ClassMethodDescriptorType, functools.partial)
# names Python and torch read on objects without the code naming them
_ALWAYS_READ = frozenset({
    # an autograd.Function's backward shapes the captured graph though no model code names it
    "backward", "setup_context", "vjp", "jvp",
    "forward", "__call__", "__getattr__", "__getattribute__", "__getitem__", "__setitem__", "__delitem__",
    "__len__", "__iter__", "__next__", "__contains__", "__bool__", "__index__", "__int__", "__float__",
    "__enter__", "__exit__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__matmul__", "__rmatmul__",
    "__truediv__", "__rtruediv__", "__floordiv__", "__mod__", "__pow__", "__rpow__", "__neg__", "__pos__",
    "__abs__", "__and__", "__or__", "__xor__", "__invert__", "__iadd__", "__imul__", "__get__",
    "__set__", "__torch_function__", "__torch_dispatch__", "__format__", "__str__", "__repr__",
})
_DESCRIBED_BY_REPR = frozenset({range, slice, type(Ellipsis), type(NotImplemented), complex, bytearray,
                                memoryview})
_OPAQUE_BUILTINS = frozenset({types.GeneratorType, types.CoroutineType, types.FrameType})


_UNSET = object()
_LOCKS = (type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Semaphore,
          threading.Event)


def _slot_names(cls: type) -> list[str]:
    slots = vars(cls).get("__slots__", ())
    if isinstance(slots, str):
        slots = (slots,)
    return [s for s in slots if s not in ("__dict__", "__weakref__")]


def _source_hash(path: str | None) -> str:
    """A source file's hash, or ``-`` for code without a readable file (``exec``, ``-c``):
    then the code objects themselves are the description."""
    try:
        return file_hash(path)
    except Uncacheable:
        return "-"


def _class_source(base: type) -> str:
    if _is_trusted(base.__module__):
        return f"{base.__module__}.{base.__qualname__}"
    try:
        source = inspect.getsourcefile(base) if base.__module__ in sys.modules else None
    except TypeError:
        source = None
    return (f"{base.__module__}.{base.__qualname__}@{_source_hash(source)}"
            f"/{package_version(base.__module__.partition('.')[0])}")


def _short(text: str) -> str:
    """Long descriptions by digest, so a fingerprint's text stays small."""
    if len(text) <= 256:
        return text
    return f"{text[:64]}...#{hashlib.sha256(text.encode()).hexdigest()[:24]}"


def _cell_filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # a cell not assigned yet
        return False
    return True


@functools.lru_cache(maxsize=8192)
def _code_digest(code: types.CodeType) -> str:
    """A digest of what a code object does, and where (two lambdas on one source line differ;
    moved lines change the source locations a capture records)."""
    consts = [_const_text(c) for c in code.co_consts]
    text = repr((code.co_filename, code.co_name, code.co_firstlineno, code.co_code.hex(), consts,
                 code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, code.co_flags,
                 code.co_argcount, code.co_kwonlyargcount, code.co_posonlyargcount,
                 code.co_linetable.hex()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _const_text(c: Any) -> str:
    if isinstance(c, types.CodeType):
        return _code_digest(c)
    if isinstance(c, (tuple, frozenset)):
        items = [_const_text(x) for x in c]
        return f"{type(c).__name__}{sorted(items) if isinstance(c, frozenset) else items}"
    return f"{type(c).__name__}:{c!r}"
