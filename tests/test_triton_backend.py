"""The triton backend end to end, in Triton's interpreter on the CPU: the test models against
eager, ``torch.compile``, implementation selection (rule, time, generated; the ``cuda``
candidate), the compile cache and the options."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import kiln
import kiln.backends.triton  # noqa: F401  (registers "triton")
import kiln.ir as ir
from kiln.backends import BackendError, get_backend
from kiln.backends.common.library import LibraryCall
from kiln.backends.common.select import Choice
from kiln.backends.triton import library
from kiln.runtime.cache import COUNTERS

from models import MODELS, first_tensor

pytest.importorskip("triton")
IMPLEMENTATIONS = {"view", "fold", "triton", "library", "cuda", "reference"}


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kiln-triton-cache"))


# ------------------------------------------------------------------ models
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2", "bert"])
def test_models_match_eager(name):
    builder, inputs_fn = MODELS[name]
    model = builder()
    args, kwargs = inputs_fn()
    with torch.no_grad():
        want = first_tensor(model(*args, **kwargs))
    compiled = kiln.compile(model, args, backend="triton", example_kwargs=kwargs)
    info = compiled.executable.info
    assert info["kernels"] > 0 and not info["fallbacks"], info["fallbacks"]
    assert set(info["choices"].values()) <= IMPLEMENTATIONS
    assert "triton" in info["choices"].values()
    torch.testing.assert_close(first_tensor(compiled(*args, **kwargs)), want, rtol=1e-4, atol=1e-5)


def test_model_kernel_kinds():
    builder, inputs_fn = MODELS["gpt2"]
    args, kwargs = inputs_fn()
    compiled = kiln.compile(builder(), args, backend="triton", example_kwargs=kwargs)
    kinds = {entry["kind"] for entry in compiled.executable.library.KERNELS.values()}
    assert {"pointwise", "reduction", "matmul", "attention"} <= kinds == set(compiled.executable.info["kinds"])


def test_torch_compile_with_the_triton_backend():
    builder, inputs_fn = MODELS["mlp"]
    model = builder()
    (x,), _ = inputs_fn()
    torch._dynamo.reset()
    optimized = torch.compile(model, backend="kiln", options={"backend": "triton"})
    with torch.no_grad():
        got = optimized(x)
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ selection
FUSED_MATMUL = """graph @g(%x: f32[8, 16], %w: f32[16, 12], %b: f32[12]) {
  %0: f32[8, 12] = matmul(%x, %w)
  %1: f32[8, 12] = add(%0, %b)
  %2: f32[8, 12] = relu(%1)
  return %2
}"""


def _graph(text: str) -> ir.Graph:
    from kiln.passes.pipeline import default_pipeline

    return default_pipeline()(ir.parse(text)).graph


def test_rule_prefers_triton_and_library_for_convolutions():
    selection = library.TritonSelection()
    graph = _graph(FUSED_MATMUL)
    assert selection.available(graph.nodes[0])[:2] == ("triton", "library")
    conv = ir.parse("""graph @g(%x: f32[1, 3, 8, 8], %w: f32[4, 3, 3, 3]) {
  %0: f32[1, 4, 6, 6] = conv(%x, %w) {stride=[1, 1], padding=[0, 0], dilation=[1, 1], groups=1}
  return %0
}""")
    assert selection.rule(conv.nodes[0]).impl == "library"
    assert selection.generated(conv.nodes[0]).impl == "triton"


def test_library_choice_runs_torch_with_a_triton_epilogue():
    graph = _graph(FUSED_MATMUL)
    backend = get_backend("triton")
    pipeline = backend.pipeline(backend.resolve_options({"cache": False}))
    exe = pipeline.run(graph, lambda n: Choice("library", "test"))
    args = [torch.randn(8, 16), torch.randn(16, 12), torch.randn(12)]
    assert exe.info["library_calls"] == 1 and exe.info["kernels"] == 1
    assert list(exe.info["choices"].values()) == ["library"]
    torch.testing.assert_close(exe(args)[0], torch.relu(args[0] @ args[1] + args[2]), rtol=1e-4, atol=1e-5)


def test_select_time_times_each_candidate_once_and_remembers(tmp_path):
    graph = _graph(FUSED_MATMUL)
    backend = get_backend("triton")
    options = {"select": "time", "cache_dir": str(tmp_path)}
    first = backend.build(graph, options)
    choice = first.info["choices"]["%2 = fused"]
    assert choice in {c.name for c in library.CANDIDATES}
    assert (tmp_path / "triton_selection.json").exists()
    again = backend.build(graph, options)
    assert again.info["choices"]["%2 = fused"] == choice


def test_a_cuda_candidate_plugs_in_as_a_library_call(monkeypatch):
    calls = []

    def cuda_call(node, persistent):
        def relu(x):
            calls.append(node.op_name)
            return torch.relu(x)
        return LibraryCall(relu, False, "fake task-mapped CUDA kernel")
    fake = types.ModuleType("kiln.backends.cuda")
    fake.supports = lambda node: node.op_name == "relu"
    fake.library_call = cuda_call
    monkeypatch.setitem(sys.modules, "kiln.backends.cuda", fake)
    monkeypatch.setattr(library.importlib.util, "find_spec", lambda name: object())
    candidate = library._cuda_candidate()
    assert candidate is not None and candidate.name == "cuda"
    selection = library.TritonSelection([*(c for c in library.CANDIDATES if c.name != "cuda"), candidate])
    backend = get_backend("triton")
    monkeypatch.setattr(type(backend), "selection", selection)
    graph = ir.parse("""graph @g(%x: f32[6]) {
  %0: f32[6] = relu(%x)
  return %0
}""")
    assert selection.available(graph.nodes[0])[:2] == ("triton", "cuda")
    exe = backend.pipeline(backend.resolve_options({"cache": False})).run(graph, lambda n: Choice("cuda", "test"))
    x = torch.randn(6)
    torch.testing.assert_close(exe([x])[0], torch.relu(x))
    assert calls == ["relu"] and exe.info["choices"] == {"%0 = relu": "cuda"}


def test_another_backend_as_a_candidate_compiles_the_node_alone():
    candidate = library.backend_candidate("cpu")  # stands for "cuda": any registered backend
    graph = _graph(FUSED_MATMUL)
    node = graph.nodes[0]
    assert candidate.runs(node)
    call = candidate.call(node, [False, True, True])
    args = [torch.randn(8, 16), torch.randn(16, 12), torch.randn(12)]
    torch.testing.assert_close(call.function(*args), torch.relu(args[0] @ args[1] + args[2]), rtol=1e-4, atol=1e-5)
    assert not candidate.runs(ir.parse("""graph @g(%a: f32[3, 3]) {
  %0: f32[3, 3] = inv(%a)
  return %0
}""").nodes[0])  # no generated kernel


# ------------------------------------------------------------------ cache and options
def test_second_build_hits_the_cache_with_a_triton_artifact(tmp_path):
    graph = _graph(FUSED_MATMUL)
    backend = get_backend("triton")
    first = backend.build(graph, {"cache_dir": str(tmp_path)})
    hits = COUNTERS["hits"]
    second = backend.build(graph, {"cache_dir": str(tmp_path)})
    assert not first.info["cache_hit"] and second.info["cache_hit"] and COUNTERS["hits"] == hits + 1
    assert first.info["source"].endswith(".py") and list(tmp_path.glob("*.triton"))
    assert second.source == first.source


def test_options_are_checked():
    backend = get_backend("triton")
    graph = _graph(FUSED_MATMUL)
    with pytest.raises(BackendError, match="no option"):
        backend.build(graph, {"threads": 2})
    with pytest.raises(BackendError, match="config must be a dict"):
        backend.build(graph, {"config": 3})
    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="needs a CUDA device"):
            backend.build(graph, {"interpret": False})


def test_interpreter_executable_refuses_tensors_of_another_device():
    exe = get_backend("triton").build(_graph(FUSED_MATMUL), {"cache": False})
    meta = [torch.empty(8, 16, device="meta"), torch.empty(16, 12, device="meta"), torch.empty(12, device="meta")]
    with pytest.raises(BackendError, match="built by the triton backend for device 'cpu'"):
        exe(meta)
