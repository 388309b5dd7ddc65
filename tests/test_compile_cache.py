"""The compile cache: keys, atomic and concurrent writes, damaged entries, the off switch,
and cache hits through the cpu backend."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kiln
import kiln.ir as ir
from kiln.backends import get_backend
from kiln.runtime import cache as cache_mod
from kiln.runtime.cache import CompileCache, cache_key

GRAPH = """
graph @cached(%x: f32[4, 16]) params(%w: f32[16], %b: f32[16]) {
  %0: f32[4, 16] = mul(%x, %w)
  %1: f32[4, 16] = add(%0, %b)
  %2: f32[4, 16] = softmax(%1) {dim=-1}
  return %2
}"""


def fused_graph() -> ir.Graph:
    from kiln.passes import default_pipeline

    return default_pipeline().run(ir.parse(GRAPH)).graph


def args() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 16, generator=g), torch.randn(16, generator=g), torch.randn(16, generator=g)]


def expected() -> torch.Tensor:
    x, w, b = args()
    return torch.softmax(x * w + b, dim=-1)


def fake_library(tmp_path: Path, data: bytes = b"\x7fELF not really") -> Path:
    path = tmp_path / "built.so"
    path.write_bytes(data)
    return path


# ------------------------------------------------------------------ keys and entries


def test_key_depends_on_every_part():
    base = cache_key("graph text", {"threads": 2}, "cc 12", "kiln 0.1 abc")
    assert base == cache_key("graph text", {"threads": 2}, "cc 12", "kiln 0.1 abc")
    assert base != cache_key("graph text ", {"threads": 2}, "cc 12", "kiln 0.1 abc")
    assert base != cache_key("graph text", {"threads": 1}, "cc 12", "kiln 0.1 abc")
    assert base != cache_key("graph text", {"threads": 2}, "cc 13", "kiln 0.1 abc")
    assert base != cache_key("graph text", {"threads": 2}, "cc 12", "kiln 0.2 abc")
    # parts are length-prefixed: moving text between parts changes the key
    assert cache_key("ab", {}, "c", "d") != cache_key("a", {}, "bc", "d")


def test_store_then_lookup_verifies_and_counts(tmp_path):
    cache = CompileCache(tmp_path / "c")
    assert cache.lookup("k1") is None
    entry = cache.store("k1", "int x;", fake_library(tmp_path), {"kernels": [1, 2]})
    hit = cache.lookup("k1")
    assert hit is not None and hit.library == entry.library and hit.manifest["kernels"] == [1, 2]
    assert hit.source.read_text() == "int x;"
    assert cache.counters["hits"] == 1 and cache.counters["misses"] == 1 and cache.counters["stores"] == 1
    leftovers = [p.name for p in (tmp_path / "c").iterdir() if p.name.endswith(".tmp")]
    assert not leftovers


@pytest.mark.parametrize("damage", ["truncate-library", "modify-library", "remove-library", "modify-source",
                                    "truncate-manifest", "wrong-key"])
def test_damaged_entries_are_never_loaded(tmp_path, damage):
    cache = CompileCache(tmp_path / "c")
    entry = cache.store("k1", "int x;", fake_library(tmp_path, b"0123456789" * 100), {})
    manifest = tmp_path / "c" / "k1.json"
    if damage == "truncate-library":
        entry.library.write_bytes(entry.library.read_bytes()[:10])
    elif damage == "modify-library":
        entry.library.write_bytes(b"X" + entry.library.read_bytes()[1:])
    elif damage == "remove-library":
        entry.library.unlink()
    elif damage == "modify-source":
        entry.source.write_text("int y;")
    elif damage == "truncate-manifest":
        manifest.write_text(manifest.read_text()[:20])
    else:
        data = json.loads(manifest.read_text())
        data["key"] = "other"
        manifest.write_text(json.dumps(data))
    assert cache.lookup("k1") is None
    assert cache.counters["corrupt"] == 1
    cache.store("k1", "int x;", fake_library(tmp_path, b"0123456789" * 100), {})
    assert cache.lookup("k1") is not None


def test_disabled_cache_writes_nothing(tmp_path):
    cache = CompileCache(tmp_path / "c", enabled=False)
    entry = cache.store("k1", "int x;", fake_library(tmp_path), {})
    assert entry.library.exists() and not (tmp_path / "c").exists()
    assert cache.lookup("k1") is None


def test_concurrent_processes_store_the_same_entry(tmp_path):
    """Several processes build and commit one key at once; the entry ends up whole."""
    script = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("cache", {str(Path(cache_mod.__file__))!r})
mod = importlib.util.module_from_spec(spec); sys.modules["cache"] = mod; spec.loader.exec_module(mod)
from pathlib import Path
lib = Path(sys.argv[1]) / f"lib{{sys.argv[2]}}.so"
lib.write_bytes(b"same bytes" * 50000)
c = mod.CompileCache(Path(sys.argv[1]) / "c")
for _ in range(20):
    c.store("key", "source", lib, {{"writer": "any"}})
    assert c.lookup("key") is not None
"""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(i)]) for i in range(4)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    entry = CompileCache(tmp_path / "c").lookup("key")
    assert entry is not None and entry.library.read_bytes() == b"same bytes" * 50000


def test_cache_module_imports_without_kiln():
    spec = importlib.util.spec_from_file_location("standalone_cache", cache_mod.__file__)
    module = importlib.util.module_from_spec(spec)
    sys.modules["standalone_cache"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["standalone_cache"]
    assert module.CompileCache is not None


# ------------------------------------------------------------------ through the backend


def test_second_build_hits_the_cache(tmp_path):
    opts = {"cache_dir": str(tmp_path)}
    first = get_backend("cpu").build(fused_graph(), opts)
    assert not first.info["cache_hit"] and first.info["kernels"] >= 1
    hits = cache_mod.COUNTERS["hits"]
    second = get_backend("cpu").build(fused_graph(), opts)
    assert second.info["cache_hit"] and cache_mod.COUNTERS["hits"] == hits + 1
    assert second.source == first.source
    torch.testing.assert_close(second(args())[0], expected())


def test_default_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "env"))
    exe = get_backend("cpu").build(fused_graph())
    assert Path(exe.info["source"]).parent == tmp_path / "env"
    assert any((tmp_path / "env").glob("*.so"))


def test_corrupted_shared_object_is_rebuilt(tmp_path):
    opts = {"cache_dir": str(tmp_path)}
    first = get_backend("cpu").build(fused_graph(), opts)
    library = next(tmp_path.glob(f"{first.info['cache_key']}.*.so"))  # the graph's, not the GEMM library
    # truncated on disk; a new inode, since truncating the loaded (mapped) file in place
    # would make this process fault when it touches the library's pages
    damaged = tmp_path / "damaged"
    damaged.write_bytes(library.read_bytes()[: len(library.read_bytes()) // 3])
    os.replace(damaged, library)
    corrupt = cache_mod.COUNTERS["corrupt"]
    rebuilt = get_backend("cpu").build(fused_graph(), opts)
    assert not rebuilt.info["cache_hit"] and cache_mod.COUNTERS["corrupt"] == corrupt + 1
    torch.testing.assert_close(rebuilt(args())[0], expected())
    assert get_backend("cpu").build(fused_graph(), opts).info["cache_hit"]
    assert first.info["cache_key"] == rebuilt.info["cache_key"]


def test_cache_option_off_leaves_the_folder_empty(tmp_path):
    exe = get_backend("cpu").build(fused_graph(), {"cache_dir": str(tmp_path / "off"), "cache": False})
    assert not (tmp_path / "off").exists()
    torch.testing.assert_close(exe(args())[0], expected())


def test_options_change_the_key(tmp_path):
    a = get_backend("cpu").build(fused_graph(), {"cache_dir": str(tmp_path), "threads": 1})
    b = get_backend("cpu").build(fused_graph(), {"cache_dir": str(tmp_path), "threads": 2})
    assert a.info["cache_key"] != b.info["cache_key"]


def test_warm_compile_of_a_model_hits_the_cache(tmp_path):
    """kiln.compile twice: the second build loads the shared object (hit counter)."""
    from models import MODELS

    builder, inputs_fn = MODELS["mlp"]
    model, (x,) = builder(), inputs_fn()[0]
    first = kiln.compile(model, (x,), backend="cpu", cache_dir=str(tmp_path))
    hits = cache_mod.COUNTERS["hits"]
    second = kiln.compile(model, (x,), backend="cpu", cache_dir=str(tmp_path))
    assert not first.executable.info["cache_hit"] and second.executable.info["cache_hit"]
    assert cache_mod.COUNTERS["hits"] == hits + 1
    torch.testing.assert_close(second(x), first(x))


def test_unwritable_cache_folder_warns_and_still_builds(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = CompileCache(blocker / "cache")
    with pytest.warns(UserWarning, match="cannot write the compile cache"):
        entry = cache.store("k1", "int x;", fake_library(tmp_path), {})
    assert entry.library.exists() and cache.counters["stores"] == 0
