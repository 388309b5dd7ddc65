"""The tvm backend end to end: every kernel kind at odd sizes against the reference backend
(kiln's schedules and TVM's), the test models against eager (``kiln.compile`` and
``torch.compile``), a translated kiln schedule printed as TIR beside kiln's own C, the
compile cache, the options, and (slow) a MetaSchedule smoke test."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install \"apache-tvm==0.27.*\")")

import kiln  # noqa: E402
import kiln.ir as ir  # noqa: E402
from kiln.backends import BackendError, get_backend  # noqa: E402
from kiln.passes import default_pipeline  # noqa: E402
from kiln.runtime.cache import COUNTERS  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import kernel_graphs  # noqa: E402
from models import MODELS, first_tensor  # noqa: E402

REL_TOL = 1e-4


@pytest.fixture(autouse=True)
def _session_cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kiln-tvm-cache"))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)) if want.numel() else 0.0


def random_inputs(graph: ir.Graph, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for v in (*graph.inputs, *graph.params):
        shape = tuple(v.type.shape)
        if v.type.dtype.is_floating:
            out.append(torch.randn(shape, generator=gen, dtype=torch.float32))
        elif v.type.dtype.name == "bool":
            out.append(torch.rand(shape, generator=gen) > 0.3)
        else:
            out.append(torch.randint(0, 10, shape, generator=gen, dtype=torch.int64))
    return out


def check(text: str, **options):
    """Fuse ``text``, build it with tvm (NaN-poisoned memory), compare with the float64
    reference on the unfused graph."""
    graph = ir.parse(text)
    fused = default_pipeline().run(graph).graph
    exe = get_backend("tvm").build(fused, {"poison": True, **options})
    ref = get_backend("reference").build(graph, {"float64": True})
    args = random_inputs(graph)
    for got, want in zip(exe(args), ref(args)):
        assert got.shape == want.shape
        assert rel_err(got, want) <= REL_TOL, (text, options, rel_err(got, want))
    assert not exe.info["fallbacks"], exe.info["fallbacks"]
    assert exe.info["kernels"] >= 1
    return exe


# ------------------------------------------------------------------ kernel kinds at odd sizes
SCHEDULES = ["kiln", "tvm"]


@pytest.mark.parametrize("schedules", SCHEDULES)
@pytest.mark.parametrize("shape", [(1,), (3, 17), (17, 1000), (2, 3, 17)])
def test_elementwise_kernels(shape, schedules):
    check(kernel_graphs.elementwise(shape), schedules=schedules)


@pytest.mark.parametrize("schedules", SCHEDULES)
@pytest.mark.parametrize("shape", [(3, 17), (1, 1000), (17, 3, 5)])
def test_reduction_and_normalization_kernels(shape, schedules):
    check(kernel_graphs.reduction(shape), schedules=schedules)


@pytest.mark.parametrize("schedules", SCHEDULES)
@pytest.mark.parametrize("select", ["rule", "generated"])
@pytest.mark.parametrize("m,k,n", [(1, 3, 17), (17, 100, 3), (3, 17, 1)])
def test_matmul_with_epilogue(select, m, k, n, schedules):
    exe = check(kernel_graphs.matmul_epilogue(m, k, n), select=select, schedules=schedules)
    assert ("library+epilogue" if select == "rule" else "generated") in exe.info["choices"].values()


@pytest.mark.parametrize("schedules", SCHEDULES)
@pytest.mark.parametrize("select", ["rule", "generated"])
@pytest.mark.parametrize("stride,groups", [(1, 1), (2, 3)])
def test_conv_kernels(select, stride, groups, schedules):
    check(kernel_graphs.conv_block(stride, groups, pool=True), select=select, schedules=schedules)


def test_timed_selection():
    exe = check("""
graph @mm(%x: f32[5, 17]) params(%w: f32[17, 9], %b: f32[9]) {
  %0: f32[5, 9] = matmul(%x, %w)
  %1: f32[5, 9] = add(%0, %b)
  %2: f32[5, 9] = tanh(%1)
  return %2
}""", select="time")
    assert set(exe.info["choices"].values()) <= {"library+epilogue", "generated", "view"}


def test_integer_bool_and_select_kernels():
    check("""
graph @mixed(%x: f32[5, 7], %i: i64[5, 7], %m: bool[5, 7]) {
  %c: f32[5, 7] = cast(%i) {dtype=f32}
  %0: f32[5, 7] = where(%m, %x, %c)
  %1: f32[5, 7] = abs(%0)
  %2: f32[5, 7] = sqrt(%1)
  %3: bool[5, 7] = gt(%2, %x)
  %4: f32[5, 7] = where(%3, %2, %x)
  %5: i64[5, 7] = mul(%i, %i)
  %6: i64[5, 7] = sub(%5, %i)
  return %4, %6
}""")


def test_tvm_schedules_use_dlight_and_blocks():
    exe = check("""
graph @rows(%x: f32[37, 300]) {
  %0: f32[37, 300] = mul(%x, %x)
  %1: f32[37] = sum(%0) {dims=[-1]}
  return %1
}""", schedules="tvm")
    notes = exe.info["tvm_notes"]
    assert "dlight" in notes.values(), notes
    assert "T.sblock" in exe.tir or "T.block" in exe.tir


# ------------------------------------------------------------------ models
# resnet18 and bert (slow) repeat what cnn and gpt2 check here, and tests/test_cpu_backend.py checks them
@pytest.mark.parametrize("name", ["mlp", "cnn", pytest.param("resnet18", marks=pytest.mark.slow), "gpt2",
                                  pytest.param("bert", marks=pytest.mark.slow)])
def test_models_match_eager(name):
    builder, inputs_fn = MODELS[name]
    model = builder()
    args, kwargs = inputs_fn()
    with torch.no_grad():
        want = first_tensor(model(*args, **kwargs))
    compiled = kiln.compile(model, args, backend="tvm", example_kwargs=kwargs)
    info = compiled.executable.info
    assert info["kernels"] > 0 and not info["fallbacks"], info["fallbacks"]
    assert rel_err(first_tensor(compiled(*args, **kwargs)), want) <= REL_TOL


@pytest.mark.parametrize("name", ["cnn", "gpt2"])
def test_models_with_tvm_schedules(name):
    builder, inputs_fn = MODELS[name]
    model = builder()
    args, kwargs = inputs_fn()
    with torch.no_grad():
        want = first_tensor(model(*args, **kwargs))
    compiled = kiln.compile(model, args, backend="tvm", example_kwargs=kwargs, schedules="tvm")
    assert not compiled.executable.info["fallbacks"]
    assert rel_err(first_tensor(compiled(*args, **kwargs)), want) <= REL_TOL


def test_torch_compile_with_the_tvm_backend():
    builder, inputs_fn = MODELS["mlp"]
    model = builder()
    (x,), _ = inputs_fn()
    torch._dynamo.reset()
    optimized = torch.compile(model, backend="kiln", options={"backend": "tvm"})
    with torch.no_grad():
        assert rel_err(optimized(x), model(x)) <= REL_TOL
        other = torch.randn_like(x)
        assert rel_err(optimized(other), model(other)) <= REL_TOL


# ------------------------------------------------------------------ kiln's schedule as TIR
MATMUL = """graph @mm(%x: f32[64, 64], %w: f32[64, 96]) {
  %0: f32[64, 96] = matmul(%x, %w)
  return %0
}"""


def c_loops(source: str, body: str) -> list[tuple[int, str, int]]:
    """``(depth, kind, extent)`` of every loop of C function ``body``, in order."""
    text = source[source.index(f"static void {body}("):]
    text = text[:text.index("\n}\n")]
    out, depth, pragma = [], 0, "serial"
    for line in text.splitlines()[1:]:
        s = line.strip()
        if s.startswith("#pragma omp parallel"):
            pragma = "parallel"
        elif s.startswith("#pragma omp simd"):
            pragma = "vectorized"
        elif s.startswith("for ("):
            m = re.match(r"for \(long (\w+) = (.+); \1 < (.+); \1\+\+\)", s)
            assert m, s
            extent = _extent(m.group(2), m.group(3))
            out.append((depth, pragma, extent))
            pragma = "serial"
        depth += s.count("{") - s.count("}")
    return out


def tir_loops(script: str) -> list[tuple[int, str, int]]:
    """``(depth, kind, extent)`` of every loop of a TVMScript function (``T.grid`` expanded)."""
    out, depths = [], []
    for line in script.splitlines():
        m = re.match(r"(\s*)for (.+?) in (.+):$", line)
        if not m:
            continue
        indent = len(m.group(1))
        while depths and depths[-1][0] >= indent:
            depths.pop()
        depth = depths[-1][1] + 1 if depths else 0
        names, head = [n.strip() for n in m.group(2).split(",")], m.group(3)
        kind = {"T.parallel": "parallel", "T.vectorized": "vectorized"}.get(head.split("(")[0], "serial")
        args = _split_args(head[head.index("(") + 1:-1])
        if head.startswith("T.grid"):
            extents = [_extent("0", a) for a in args]
        else:
            extents = [_extent(args[0], args[1]) if len(args) == 2 else _extent("0", args[0])]
        for k, (_, extent) in enumerate(zip(names, extents)):
            out.append((depth + k, kind, extent))
        depths.append((indent, depth + len(names) - 1))
    return out


def _split_args(text: str) -> list[str]:
    parts, level, cur = [], 0, ""
    for ch in text:
        level += ch == "("
        level -= ch == ")"
        if ch == "," and level == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + [cur.strip()] if cur.strip() else parts


def _extent(lower: str, upper: str) -> int:
    """``upper - lower`` of two affine bound texts in one tile iterator (``32 * v2 + 32``)."""
    def norm(e: str) -> str:
        return re.sub(r"T\.int64\((\d+)\)", r"\1", e).replace(" ", "")
    lo, hi = norm(lower), norm(upper)
    if lo and hi.startswith(lo + "+"):
        return int(hi[len(lo) + 1:])
    return int(eval(hi, {}, {})) - int(eval(lo, {}, {}))  # noqa: S307 - constant bounds only


def test_kiln_schedule_translates_loop_for_loop():
    graph = default_pipeline().run(ir.parse(MATMUL)).graph
    options = {"select": "generated", "threads": 2, "cache": False}
    cpu = get_backend("cpu").build(graph, options)
    tvm_exe = get_backend("tvm").build(graph, options)
    trace = [step["primitive"] for step in tvm_exe.info["schedules"]["%0 = matmul"]]
    assert {"parallel", "vectorize", "tile"} <= set(trace), trace
    assert tvm_exe.info["schedules"] == cpu.info["schedules"]
    print("kiln's C:\n" + cpu.source[cpu.source.index("static void kiln_k0_body"):].split("\n}\n")[0] + "\n}")
    print("TIR:\n" + tvm_exe.tir)
    want, got = c_loops(cpu.source, "kiln_k0_body"), tir_loops(tvm_exe.tir)
    assert got == want, (want, got)
    assert [k for _, k, _ in got].count("parallel") == 1 and ("vectorized" in [k for _, k, _ in got])
    x, w = torch.randn(64, 64), torch.randn(64, 96)
    assert rel_err(tvm_exe([x, w])[0], x @ w) <= REL_TOL


# ------------------------------------------------------------------ cache, options
def test_compile_cache_holds_the_tvm_library(tmp_path):
    text = """graph @c(%x: f32[9, 13]) {
  %0: f32[9, 13] = exp(%x)
  %1: f32[9, 13] = mul(%0, %x)
  return %1
}"""
    graph = default_pipeline().run(ir.parse(text)).graph
    first = get_backend("tvm").build(graph, {"cache_dir": str(tmp_path)})
    assert not first.info["cache_hit"]
    hits = COUNTERS["hits"]
    second = get_backend("tvm").build(graph, {"cache_dir": str(tmp_path)})
    assert second.info["cache_hit"] and COUNTERS["hits"] == hits + 1
    artifacts = list(tmp_path.glob("*.tvm"))
    assert len(artifacts) == 1 and {"lib.so", "kernels.json"} <= set(zipfile.ZipFile(artifacts[0]).namelist())
    x = torch.randn(9, 13)
    torch.testing.assert_close(second([x])[0], x.exp() * x)
    other = get_backend("tvm").build(graph, {"cache_dir": str(tmp_path), "schedules": "tvm"})
    assert not other.info["cache_hit"]
    # the module document alone rebuilds the library (TVMScript parsed back)
    from kiln.backends.tvm.toolchain import TvmToolchain, host_target, load_artifact

    (tmp_path / "rebuild").mkdir()
    archive = TvmToolchain(host_target()).build(other.source, tmp_path / "rebuild")
    library, _ = load_artifact(archive)
    out = torch.empty(9, 13)
    library["kiln_k0"](ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()))
    torch.testing.assert_close(out, x.exp() * x)


def test_threads_share_nothing():
    graph = default_pipeline().run(ir.parse("""graph @t(%x: f32[33, 65]) {
  %0: f32[33, 65] = softmax(%x) {dim=-1}
  return %0
}""")).graph
    exe = get_backend("tvm").build(graph)
    inputs = [torch.randn(33, 65) for _ in range(4)]
    results: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        for _ in range(20):
            results[i] = exe([inputs[i]])[0]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, x in enumerate(inputs):
        torch.testing.assert_close(results[i], torch.softmax(x, -1))


@pytest.mark.parametrize("options,message", [
    ({"schedules": "fast"}, "schedules='fast' is not one of kiln, tvm, tuned"),
    ({"tune_trials": 4}, "tune_trials needs schedules='tuned'"),
    ({"tune_trials": -1, "schedules": "tuned"}, "tune_trials must be an int >= 0"),
    ({"target": {"kind": "cuda"}}, "target kind 'cuda' is not supported"),
    ({"target": "llvm -mcpu=native"}, "option target must be a dict"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_options_are_refused(options, message):
    graph = ir.parse("""graph @o(%x: f32[3]) {
  %0: f32[3] = exp(%x)
  return %0
}""")
    with pytest.raises(BackendError, match=re.escape(message)):
        get_backend("tvm").build(graph, options)


def test_half_precision_kernels_fall_back_to_the_reference():
    graph = ir.parse("""graph @h(%x: f16[4, 5]) {
  %0: f16[4, 5] = exp(%x)
  return %0
}""")
    exe = get_backend("tvm").build(graph)
    assert exe.info["fallbacks"] and "f16" in next(iter(exe.info["fallbacks"].values()))
    x = torch.randn(4, 5).half()
    torch.testing.assert_close(exe([x])[0], x.float().exp().half(), rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------ MetaSchedule
@pytest.mark.slow
def test_metaschedule_smoke(tmp_path):
    pytest.importorskip("psutil", reason="MetaSchedule's search needs psutil")
    text = """graph @ms(%x: f32[16, 33]) {
  %0: f32[16, 33] = exp(%x)
  %1: f32[16, 1] = sum(%0) {dims=[-1], keepdim=true}
  %2: f32[16, 33] = div(%0, %1)
  return %2
}"""
    exe = check(text, schedules="tuned", tune_trials=4, cache_dir=str(tmp_path))
    assert any(note == "MetaSchedule record" for note in exe.info["tvm_notes"].values()), exe.info["tvm_notes"]
    assert list((tmp_path / "tvm_tuning").glob("*.json"))
    again = check(text, schedules="tuned", cache_dir=str(tmp_path))  # no trials: the records are found
    assert again.info["tvm_notes"] == exe.info["tvm_notes"]


# ------------------------------------------------------------------ import, missing TVM, CLI
def test_importing_kiln_does_not_import_tvm_and_a_missing_tvm_is_explained():
    code = ("import sys, kiln\n"
            "assert 'tvm' not in sys.modules, 'importing kiln imported tvm'\n"
            "assert 'tvm' in kiln.backends.available_backends()\n"
            "sys.modules['tvm'] = None\n"
            "try:\n"
            "    kiln.backends.get_backend('tvm')\n"
            "except kiln.backends.BackendError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert "pip install \"apache-tvm==0.27.*\"" in out.stdout and "backend='cpu'" in out.stdout


@pytest.mark.slow
def test_kiln_tune_cli(tmp_path, capsys):
    pytest.importorskip("psutil", reason="MetaSchedule's search needs psutil")
    from kiln.compiler.cli import main

    assert main(["tune", "--backend", "tvm", "--models", "mlp", "--trials", "4", "--cache-dir", str(tmp_path),
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"mlp: [1-9]\d* of \d+ kernels tuned", out), out
    assert list((tmp_path / "tvm_tuning").glob("*.json"))
