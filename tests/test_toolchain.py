"""The toolchain layer: the ``Toolchain`` protocol, one compiler search, the artifact cache
keyed by artifact type, and the loop-program runner built through both."""

from __future__ import annotations

import ctypes
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import kiln.loops as kl
from kiln.backends.base import BackendError
from kiln.backends.common.toolchain import Toolchain, build_cached, find_tool
from kiln.backends.cpu import microgemm, toolchain
from kiln.backends.cpu.native import DEFAULT_FLAGS, compile_c, loop_compiler
from kiln.runtime.cache import CompileCache, artifact_key, cache_key

needs_cc = pytest.mark.skipif(toolchain.c_compiler() is None, reason="no C compiler")


class Reverser:
    """A toolchain whose "compiler" reverses the source: enough to exercise the cache."""

    name = "reverse"
    artifact = "rev"
    source_suffix = "txt"

    def __init__(self, version: str = "1"):
        self.version = version
        self.builds = 0

    def identity(self) -> str:
        return f"reverse {self.version}"

    def build(self, source: str, folder: Path) -> Path:
        self.builds += 1
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / f"built{self.builds}.rev"
        out.write_text(source[::-1])
        return out


# ------------------------------------------------------------------ the protocol


def test_toolchains_satisfy_the_protocol():
    assert isinstance(Reverser(), Toolchain)
    cc = toolchain.CCompiler("cc", ("-O2",))
    assert isinstance(cc, Toolchain)
    assert (cc.name, cc.artifact, cc.source_suffix) == ("cc", "so", "c")


def test_build_cached_builds_once_per_source_and_identity(tmp_path):
    cache = CompileCache(tmp_path / "c")
    chain = Reverser()
    first = build_cached(chain, "abc", cache, manifest={"note": 1})
    assert first.library.read_text() == "cba" and first.source.read_text() == "abc"
    assert first.library.name.endswith(".rev") and first.source.name.endswith(".txt")
    assert first.artifact == "rev" and first.manifest["artifact"] == "rev" and first.manifest["note"] == 1
    again = build_cached(chain, "abc", cache)
    assert chain.builds == 1 and again.library == first.library
    assert first.key == artifact_key("rev", "abc", "reverse 1")
    build_cached(chain, "abd", cache)  # another source
    newer = Reverser("2")
    build_cached(newer, "abc", cache)  # another compiler version
    assert chain.builds == 2 and newer.builds == 1
    assert cache.counters == {"hits": 1, "misses": 3, "corrupt": 0, "stores": 3}


def test_build_cached_with_the_cache_off_builds_every_time(tmp_path):
    cache = CompileCache(tmp_path / "c", enabled=False)
    chain = Reverser()
    build_cached(chain, "abc", cache)
    entry = build_cached(chain, "abc", cache)
    assert chain.builds == 2 and entry.library.read_text() == "cba" and not (tmp_path / "c").exists()


def test_build_errors_store_nothing(tmp_path):
    class Broken(Reverser):
        def build(self, source, folder):
            raise toolchain.CompileError("no")

    cache = CompileCache(tmp_path / "c")
    with pytest.raises(toolchain.CompileError):
        build_cached(Broken(), "abc", cache)
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").glob("*.json"))


# ------------------------------------------------------------------ one cache, keyed by artifact type


def test_the_cache_is_keyed_by_artifact_type(tmp_path):
    cache = CompileCache(tmp_path / "c")
    built = tmp_path / "k.cubin"
    built.write_bytes(b"\x7fcubin")
    entry = cache.store("k1", "__global__ void f() {}", built, {"kernels": ["f"]}, artifact="cubin",
                        source_suffix="cu")
    assert entry.library.name.endswith(".cubin") and entry.source.name.endswith(".cu")
    assert json.loads((tmp_path / "c" / "k1.json").read_text())["artifact"] == "cubin"
    hit = cache.lookup("k1", "cubin")
    assert hit is not None and hit.artifact == "cubin" and hit.library.read_bytes() == b"\x7fcubin"
    assert cache.lookup("k1") is None  # asks for a shared object: a miss, not a damaged entry
    assert cache.counters["corrupt"] == 0 and cache.counters["misses"] == 1
    with pytest.raises(ValueError, match="artifact"):
        cache.store("k2", "x", built, {}, artifact="../so")
    with pytest.raises(ValueError, match="source suffix"):
        cache.store("k2", "x", built, {}, source_suffix="c/x")


def test_entries_without_an_artifact_type_are_shared_objects(tmp_path):
    cache = CompileCache(tmp_path / "c")
    built = tmp_path / "x.so"
    built.write_bytes(b"so bytes")
    cache.store("k1", "int x;", built, {})
    manifest = tmp_path / "c" / "k1.json"
    data = json.loads(manifest.read_text())
    del data["artifact"]
    manifest.write_text(json.dumps(data))
    entry = cache.lookup("k1")
    assert entry is not None and entry.artifact == "so"


def test_artifact_keys_depend_on_every_part():
    base = artifact_key("so", "int x;", "cc 12")
    assert base == artifact_key("so", "int x;", "cc 12")
    assert len({base, artifact_key("cubin", "int x;", "cc 12"), artifact_key("so", "int y;", "cc 12"),
                artifact_key("so", "int x;", "cc 13"), artifact_key("so", "int x;", "cc 12", "extra")}) == 5
    assert base != cache_key("int x;", {}, "cc 12", "")


# ------------------------------------------------------------------ one compiler search


def test_one_compiler_search(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PATH", "")
    assert toolchain.c_compiler() is None
    with pytest.raises(BackendError, match="C compiler"):
        toolchain.find_compiler()
    fake = tmp_path / "mycc"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert toolchain.c_compiler() is None  # none of cc, gcc, clang; $CC names nothing that exists
    monkeypatch.setenv("CC", "mycc")
    assert toolchain.c_compiler() == "mycc" == toolchain.find_compiler()
    assert find_tool("KILN_TEST_NVCC", ("mycc",)) == "mycc"
    assert find_tool("KILN_TEST_NVCC", ("nvcc-not-here",)) is None


def test_the_ir_runs_no_compiler():
    assert importlib.util.find_spec("kiln.ir.loops.native") is None
    assert kl.compile_c is compile_c


# ------------------------------------------------------------------ the C compiler as a toolchain


@needs_cc
def test_cpu_compiler_identity_names_compiler_flags_and_machine():
    cc = toolchain.find_compiler()
    chain = toolchain.cpu_compiler(cc)
    ident = chain.identity()
    assert ident == toolchain.compiler_identity(cc)
    assert f"cc={cc}" in ident and "-march=native" in ident and "machine=" in ident and "vector-math=" in ident
    assert loop_compiler(cc).identity() != ident and "-ffp-contract=off" in loop_compiler(cc).identity()
    assert loop_compiler(cc, openmp=True).flags == (*DEFAULT_FLAGS, "-fopenmp", "-shared", "-fPIC")


@needs_cc
def test_c_compiler_builds_through_the_cache_and_reports_errors(tmp_path):
    chain = toolchain.cpu_compiler()
    cache = CompileCache(tmp_path / "c")
    source = "int kiln_twice(int x) { return 2 * x; }\n"
    entry = build_cached(chain, source, cache)
    assert entry.library.suffix == ".so" and entry.source.suffix == ".c"
    assert ctypes.CDLL(str(entry.library)).kiln_twice(21) == 42
    assert build_cached(chain, source, cache).library == entry.library and cache.counters["hits"] == 1
    with pytest.raises(toolchain.CompileError, match="kiln bug") as info:
        chain.build("int broken(", tmp_path / "scratch")
    assert info.value.stderr and Path(info.value.source_path).read_text() == "int broken("


@needs_cc
def test_microgemm_is_content_addressed_in_the_artifact_cache(tmp_path):
    cc = toolchain.find_compiler()
    assert microgemm.library(CompileCache(tmp_path), cc) is not None
    key = artifact_key("so", microgemm.SOURCE, toolchain.cpu_compiler(cc).identity())
    entry = CompileCache(tmp_path).lookup(key)
    assert entry is not None and entry.source.read_text() == microgemm.SOURCE


# ------------------------------------------------------------------ the loop-program runner

COUNT = """program count(N: i64) {
  buffer A: f64[N]
  for i in [0, N) {
    S0: A[i] += 1.0
  }
}"""


@needs_cc
def test_compile_c_builds_once_into_the_artifact_cache(tmp_path):
    cache = CompileCache(tmp_path / "c")
    program = kl.parse(COUNT)
    kernel = compile_c(program, cache=cache)
    assert kernel.path.parent == tmp_path / "c" and kernel.path.suffix == ".so"
    assert cache.counters["stores"] == 1 and cache.counters["hits"] == 0
    again = compile_c(program, cache=cache)
    assert again.path == kernel.path and cache.counters["hits"] == 1
    assert compile_c(program, openmp=True, cache=cache).path != kernel.path  # other flags, other artifact
    a = np.zeros(5)
    again({"N": 5}, {"A": a})
    assert a.tolist() == [1.0] * 5


@needs_cc
def test_native_time_runs_exactly_repeat_times(tmp_path):
    kernel = compile_c(kl.parse(COUNT), cache=CompileCache(tmp_path))
    a = np.zeros(3)
    seconds = kernel.time({"N": 3}, {"A": a}, repeat=4)
    assert a.tolist() == [4.0] * 3 and 0 < seconds < 1


@needs_cc
def test_compile_c_reports_compiler_failures(monkeypatch, tmp_path):
    monkeypatch.setattr(toolchain.CCompiler, "build", lambda self, source, folder: (_ for _ in ()).throw(
        toolchain.CompileError("failed", "error: something", "x.c")))
    with pytest.raises(RuntimeError, match="compiling count failed:\nerror: something\n--- source ---"):
        compile_c(kl.parse(COUNT), cache=CompileCache(tmp_path))
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(RuntimeError, match="no C compiler"):
        compile_c(kl.parse(COUNT), cache=CompileCache(tmp_path))
