"""The cuda backend in host emulation (``emulate=True``; no GPU here): the test models and the
CI subset of the zoo (their units also compiled with nvcc) against eager, ``torch.compile``,
the kernel sources, the compile cache, the selection rule, half-precision kernels, AMP,
training steps, kernel logs and the errors of a machine without a GPU.  Builds share one
compile-cache folder per session (the nvcc tests of test_cuda_nvcc.py reuse it)."""

from __future__ import annotations

import copy
import ctypes
import re

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import kiln
from kiln.backends.base import BackendError
from kiln.backends.cpu.toolchain import cpu_compiler
from kiln.backends.cuda.backend import CudaBackend, EmulatedExecutable
from kiln.backends.cuda.emulation import HALF_HELPERS
from kiln.backends.cuda.toolchain import NvccCompiler, find_nvcc
from kiln.ir import DType
from kiln.zoo.models import FAST, ZOO
from kiln.zoo.run import run_entry

from eagercheck import Fn, assert_same, randn
from models import MODELS

TEST_MODELS = ("mlp", "cnn", "resnet18", "gpt2", "bert")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "kiln-cuda-cache")


@pytest.fixture(scope="module")
def built(cache_dir):
    """name -> (model, args, kwargs, compiled module), built on first use."""
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            build, inputs = MODELS[name]
            model = build()
            args, kwargs = inputs()
            compiled = kiln.compile(model, args, backend="cuda", emulate=True, example_kwargs=kwargs,
                                    cache_dir=cache_dir)
            made[name] = (model, args, kwargs, compiled)
        return made[name]
    return get


def _leaves(out) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", TEST_MODELS)
def test_test_models_match_eager(name, built, one_torch_thread):
    model, args, kwargs, compiled = built(name)
    with torch.no_grad():
        want = _leaves(model(*args, **kwargs))
        got = _leaves(compiled(*args, **kwargs))
    assert_same(got, want, rtol=1e-4, atol=1e-5)
    exe = compiled.executable
    assert isinstance(exe, EmulatedExecutable)
    assert exe.info["fallbacks"] == {}, exe.info["fallbacks"]
    assert exe.info["kernels"] >= 1 and exe.info["gpu_kernels"] >= 1
    # every GPU kernel the wrappers launch has its CUDA source, and nothing else is there
    launched = set(re.findall(r"^  (kiln_k\d+_\d+)<<<", exe.cuda_source, re.M))
    assert launched == set(compiled.sources) == set(exe.sources)
    assert all("__global__" in text for text in compiled.sources.values())
    assert sum(exe.info["kinds"].values()) == exe.info["gpu_kernels"]


def test_the_sources_hold_no_user_text(built):
    _, _, _, compiled = built("mlp")
    text = compiled.executable.cuda_source + compiled.executable.source
    for user in ("fc1", "fc2", "weight", "bias", "MLP"):
        assert user not in text, user


def test_a_warm_build_restores_the_sources(built, cache_dir):
    model, args, kwargs, first = built("mlp")
    again = kiln.compile(model, args, backend="cuda", emulate=True, cache_dir=cache_dir)
    assert again.executable.info["cache_hit"]
    assert again.sources == first.sources and again.executable.info["kinds"] == first.executable.info["kinds"]
    with torch.no_grad():
        assert_same(again(*args), model(*args), rtol=1e-4, atol=1e-5)


def test_the_rule_generates_kernels_and_calls_the_library_for_convolutions(built):
    choices = built("resnet18")[3].executable.info["choices"]
    convs = [impl for label, impl in choices.items() if impl == "library+epilogue"]
    assert len(convs) == 20  # the 20 convolutions (with their batch norms) of ResNet-18
    assert set(choices.values()) <= {"library+epilogue", "generated", "view"}
    kinds = built("gpt2")[3].executable.info["kinds"]
    assert kinds.get("matmul", 0) >= 1, kinds
    assert set(built("gpt2")[3].executable.info["choices"].values()) <= {"generated", "view"}


def test_torch_compile_runs_the_emulated_kernels(cache_dir, monkeypatch, one_torch_thread):
    calls = []
    original = EmulatedExecutable.__call__

    def counting(self, args):
        calls.append(self.graph.name)
        return original(self, args)

    monkeypatch.setattr(EmulatedExecutable, "__call__", counting)
    model = MODELS["mlp"][0]()
    (x,), _ = MODELS["mlp"][1]()
    compiled = torch.compile(model, backend="kiln", dynamic=False,
                             options={"backend": "cuda", "emulate": True, "cache_dir": cache_dir})
    with torch.no_grad():
        assert_same(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert calls


class _Recording(CudaBackend):
    """The emulated cuda backend, keeping every executable it builds."""

    def __init__(self) -> None:
        super().__init__(emulate=True)
        self.built: list[EmulatedExecutable] = []

    def build(self, graph, options=None):
        exe = super().build(graph, options)
        self.built.append(exe)
        return exe


CUDA_CI_ZOO = ("llama", "convnext", "pointnet_knn")
"""The zoo models of the CI run of the cuda test (a GQA decoder, depthwise convolutions, a
gather-heavy point net); ``-m slow`` runs the rest of the fast zoo subset, which
``tests/zoo`` also checks on the reference backend."""


@pytest.mark.parametrize("name", [n if n in CUDA_CI_ZOO else pytest.param(n, marks=pytest.mark.slow) for n in FAST])
def test_zoo_models_match_eager_and_their_units_compile_with_nvcc(name, one_torch_thread, tmp_path):
    backend = _Recording()
    result = run_entry(ZOO[name], ("inference",), backend=backend)
    assert result.status == "pass", result.first_error
    assert result.checks["inference"].compared >= 1
    (exe,) = backend.built
    assert exe.info["gpu_kernels"] > 0, exe.info
    nvcc = find_nvcc()
    if nvcc is not None:  # compile only: no GPU here
        NvccCompiler(nvcc).check(exe.cuda_source, tmp_path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_kernels_round_like_the_reference(dtype, cache_dir):
    def f(x, w):
        y = torch.softmax(x * 3 + 1, -1)  # rows kernel
        return y @ w, torch.relu(x).sum(0)  # matmul, reduction
    x, w = randn(5, 33).to(dtype), randn(33, 7, seed=1).to(dtype)
    got = kiln.compile(Fn(f), (x, w), backend="cuda", emulate=True, cache_dir=cache_dir)
    want = kiln.compile(Fn(f), (x, w), backend="reference")
    assert got.executable.info["fallbacks"] == {}
    assert any(DType.float16 == v.dtype or DType.bfloat16 == v.dtype for v in got.graph.inputs)
    tol = 1e-3 if dtype == torch.float16 else 8e-3
    assert_same(list(got(x, w)), list(want(x, w)), rtol=tol, atol=tol)


def test_half_conversions_are_exact(tmp_path):
    source = HALF_HELPERS + """
void to_float(const unsigned short *h, float *f16, float *bf16, long n) {
  for (long i = 0; i < n; i++) { f16[i] = kiln_f16_load(h[i]); bf16[i] = kiln_bf16_load(h[i]); }
}
void from_float(const float *x, unsigned short *f16, unsigned short *bf16, long n) {
  for (long i = 0; i < n; i++) { f16[i] = kiln_f16_store(x[i]); bf16[i] = kiln_bf16_store(x[i]); }
}
"""
    lib = ctypes.CDLL(str(cpu_compiler().build(source, tmp_path)))
    for fn in (lib.to_float, lib.from_float):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    bits = np.arange(1 << 16, dtype=np.uint16)
    f16, bf16 = np.empty(1 << 16, np.float32), np.empty(1 << 16, np.float32)
    lib.to_float(bits.ctypes.data, f16.ctypes.data, bf16.ctypes.data, bits.size)
    np.testing.assert_array_equal(f16, bits.view(np.float16).astype(np.float32))
    want_bf16 = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(bf16, want_bf16)
    g = np.random.default_rng(0)
    with np.errstate(invalid="ignore", over="ignore"):
        x = np.concatenate([g.standard_normal(20000) * 10.0 ** g.integers(-9, 6, 20000),
                            [0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e-8, 2.0**-24, 2.0**-25, np.inf, -np.inf, np.nan],
                            f16[::7].astype(np.float64) * (1 + 2.0**-11)]).astype(np.float32)  # ties
        want_f16 = x.astype(np.float16)
    h, b = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
    lib.from_float(x.ctypes.data, h.ctypes.data, b.ctypes.data, x.size)
    np.testing.assert_array_equal(h.view(np.float16), want_f16)
    want = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(b[~nan], want[~nan])
    assert nan.any() and np.all((b[nan] & 0x7F80) == 0x7F80) and np.all(b[nan] & 0x7F)  # NaN stays NaN


def _bf16_close(got: torch.Tensor, want: torch.Tensor, scale: float = 3e-2) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= scale * want.abs().max().item() + 1e-3, err
    assert err > 0  # it did compute in low precision


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_amp_bf16_matches_eager_within_bf16_tolerance(name, cache_dir, one_torch_thread):
    build, inputs = MODELS[name]
    model = build()
    args, kwargs = inputs()
    compiled = kiln.compile(model, args, backend="cuda", emulate=True, amp="bf16", example_kwargs=kwargs,
                            cache_dir=cache_dir)
    assert compiled.executable.info["fallbacks"] == {}
    assert any(v.dtype == DType.bfloat16 for n in compiled.graph.nodes for v in n.outputs)
    with torch.no_grad():
        for got, want in zip(_leaves(compiled(*args, **kwargs)), _leaves(model(*args, **kwargs))):
            assert got.dtype == want.dtype
            _bf16_close(got, want)


def test_amp_runs_before_fusion_in_every_kind_of_pipeline():
    from kiln.compiler.api import amp_passes

    assert amp_passes("default", None).identity == kiln.passes.pipeline.resolve_passes("default").identity
    default = amp_passes("default", "bf16").identity
    assert default.endswith("| amp,fuse fixpoint=False max_iterations=8")  # bf16 is amp's default dtype
    assert ",fuse" not in default.split(" | ")[0]
    assert amp_passes("cse,fuse,dce", "f16").identity.startswith("cse,amp{dtype=f16},fuse,dce ")
    assert amp_passes("cse", "bfloat16").identity.startswith("cse,amp ")
    assert amp_passes(None, "float16").identity.startswith("amp{dtype=f16} ")
    with pytest.raises(kiln.KilnError, match="unknown low-precision dtype"):
        amp_passes("default", "fp8")


def _train(amp: str | None, cache_dir: str, steps: int = 3):
    torch.manual_seed(0)
    model = MODELS["mlp"][0]().train()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 64), torch.randn(8, 10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    step = kiln.compile_train(model, nn.functional.mse_loss, opt, (x, y), backend="cuda", emulate=True, amp=amp,
                              cache_dir=cache_dir)
    losses = []
    for _ in range(steps):
        loss = step(x, y)
        eager_opt.zero_grad()
        want = nn.functional.mse_loss(eager(x), y)
        want.backward()
        eager_opt.step()
        losses.append((loss.item(), want.item()))
    return step, model, eager, losses


def test_a_training_step_matches_eager(cache_dir, one_torch_thread):
    step, model, eager, losses = _train(None, cache_dir)
    assert step._executable.info["fallbacks"] == {}
    for got, want in losses:
        assert got == pytest.approx(want, rel=1e-5)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_float16_training_with_loss_scaling(cache_dir, one_torch_thread):
    step, model, eager, losses = _train("float16", cache_dir)
    assert step.scaler is not None and step.loss_scale > 0 and step.skipped_steps == 0
    for got, want in losses:
        assert got == pytest.approx(want, rel=2e-3)
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), eager.parameters()))
    assert moved < 5e-2


def test_a_kernel_that_cannot_be_generated_runs_its_reference(cache_dir):
    def f(x):
        return torch.relu(x) + torch.special.digamma(x.abs() + 1)  # digamma: no compute definition
    x = randn(4, 5)
    compiled = kiln.compile(Fn(f), (x,), backend="cuda", emulate=True, cache_dir=cache_dir)
    (reason,) = compiled.executable.info["fallbacks"].values()
    assert "no compute definition" in reason
    assert_same(compiled(x), f(x), rtol=1e-5, atol=1e-6)


def test_kernel_logs(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("KILN_LOGS", "kernels")
    x = randn(3, 50)
    kiln.compile(Fn(lambda a: torch.tanh(a) * 2), (x,), backend="cuda", emulate=True, cache_dir=str(tmp_path))
    err = capsys.readouterr().err
    assert re.search(r"cuda kernel kiln_k0_0: choice generated \(\w+\), time -", err), err
    assert "__global__" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_emulate_false_says_how_to_go_on():
    with pytest.raises(BackendError, match="pass emulate=True"):
        kiln.compile(Fn(torch.relu), (randn(4),), backend="cuda")
    with pytest.raises(BackendError, match="no option"):
        kiln.compile(Fn(torch.relu), (randn(4),), backend="cuda", emulate=True, threads=2)


# ------------------------------------------------------------------ the GPU check script
def _report(tmp_path, cache_dir, monkeypatch, argv):
    from benchmarks import gpu_check

    monkeypatch.setenv("KILN_CACHE_DIR", cache_dir)
    out = tmp_path / "gpu.md"
    assert gpu_check.main(["--dry-run", "--out", str(out), *argv]) == 0
    return out.read_text()


def test_gpu_check_dry_run(tmp_path, cache_dir, monkeypatch, one_torch_thread):
    text = _report(tmp_path, cache_dir, monkeypatch, ["--systems", "kiln-cuda", "--only", "mlp,resnet50"])
    for section in ("## Environment", "## Correctness against eager", "## Timing", "## Matmul roofline"):
        assert section in text
    assert re.search(r"^\| mlp \| fp32 \| kiln-cuda \| pass \| ", text, re.M), text
    assert re.search(r"^\| mlp \| bf16 \| kiln-cuda \| pass \| ", text, re.M), text
    assert re.search(r"^\| resnet50 b1 \| kiln-cuda \| ok \| [0-9.]+ \| [0-9.]+ \|", text, re.M), text
    assert re.search(r"^\| 64\^3 \| bfloat16 \| kiln-cuda \| ok \| ", text, re.M), text
    assert "gpt2" not in text.split("## Timing")[0].split("## Correctness")[1]  # --only was honoured


@pytest.mark.slow
def test_gpu_check_dry_run_every_section_and_system(tmp_path, cache_dir, monkeypatch):
    text = _report(tmp_path, cache_dir, monkeypatch, [])
    assert "| gpt2 train step | fp32 | kiln-cuda | pass |" in text
    assert re.search(r"^\| gpt2-small train bf16 b2 \| kiln-cuda \| ok \|", text, re.M), text
    assert "kiln-triton" in text


def test_gpu_check_script_runs_the_module():
    from pathlib import Path
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    text = script.read_text()
    assert "python -m benchmarks.gpu_check" in text and "--dry-run" in text and "timeout" in text
