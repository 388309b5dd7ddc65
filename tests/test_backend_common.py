"""The device-neutral backend core (kiln.backends.common) and the device-aware call plan:
a backend that plugs into the build pipeline with its own hooks, ``Backend.supports``,
allocators and kernel launchers, prepared-weight steps, implementation selection."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kiln.ir as ir
from kiln.backends import BackendError, get_backend
from kiln.backends.common.build import BuildPipeline, CompiledBackend
from kiln.backends.common.select import Selection
from kiln.backends.common.toolchain import Toolchain
from kiln.ir.registry import OpDef
from kiln.runtime.cache import CompileCache
from kiln.runtime.call_plan import (
    HOST,
    CallPlan,
    NativeRunStep,
    PackStep,
    SlotSpec,
    TorchDeviceAllocator,
    TorchStep,
)

GRAPH = """
graph @toy(%x: f32[3, 4], %y: f32[3, 4]) {
  %0: f32[3, 4] = add(%x, %y)
  %1: f32[3, 4] = exp(%0)
  %2: f32[3, 4] = exp(%x)
  %3: f32[3, 4] = mul(%1, %2)
  return %3
}"""


# ------------------------------------------------------------------ a backend of its own
class PythonLauncher:
    """Launches "kernels" that are torch functions writing their last slot."""

    def __init__(self, table):
        self.table = table
        self.launches = 0

    def bind(self, kernels, static, template):
        calls = [(self.table[index], slots) for index, slots, offsets in kernels]
        assert all(not any(offsets) for _, _, offsets in kernels)

        def call(slots):
            self.launches += 1
            for fn, args in calls:
                fn(*[slots[s] for s in args[:-1]], out=slots[args[-1]])
        return call


TORCH_OPS = {"add": torch.add, "exp": torch.exp, "mul": torch.mul}


class ToyToolchain:
    """A :class:`Toolchain` whose "artifact" is the source text itself."""

    name = "toy"
    artifact = "toy"
    source_suffix = "txt"

    def identity(self) -> str:
        return "toy-toolchain 1"

    def build(self, source: str, folder: Path) -> Path:
        path = folder / "toy.out"
        path.write_text(source)
        return path


class ToyBuild(BuildPipeline):
    """Every hook a code-generating backend fills, with a one-line "source" per kernel."""

    def build_identity(self) -> str:
        return "toy"

    def kernel_source(self, symbol, op):
        if op.node.op_name not in TORCH_OPS:
            raise NotImplementedError(f"no toy kernel for {op.node.op_name}")
        return (symbol, op.node.op_name, tuple(str(v.type) for v in op.node.inputs)), []

    def source_identity(self, source):
        return repr(source[1:])

    def translation_unit(self, sources):
        return "\n".join(f"{symbol} {name}" for symbol, name, _ in sources)

    def load(self, path, symbols, plan):
        if path is None:
            return None, None
        by_symbol = dict(line.split() for line in Path(path).read_text().splitlines())
        launcher = PythonLauncher([TORCH_OPS[by_symbol[s]] for s in symbols])
        self.backend.launchers.append(launcher)
        return by_symbol, launcher


class ToyBackend(CompiledBackend):
    name = "toy"
    option_defaults = {"select": "rule", "poison": False, "cache_dir": None}
    selection = Selection(lambda node: False)  # no library, nothing run on the host

    def __init__(self):
        self.launchers: list[PythonLauncher] = []

    def pipeline(self, opts):
        return ToyBuild(self, CompileCache(opts["cache_dir"]), ToyToolchain(), poison=opts["poison"])


def test_a_backend_plugs_into_the_build_pipeline_with_its_hooks(tmp_path):
    backend = ToyBackend()
    graph = ir.parse(GRAPH)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    first = backend.build(graph, {"cache_dir": str(tmp_path), "poison": True})
    torch.testing.assert_close(first([x, y])[0], (x + y).exp() * x.exp())
    assert first.info["kernels"] == 4 and not first.info["cache_hit"] and not first.info["fallbacks"]
    assert first.source.count(" exp") == 1  # the two identical exp kernels share one function
    assert backend.launchers[-1].launches == 1  # four kernels, one launch
    assert isinstance(ToyToolchain(), Toolchain) and first.info["source"].endswith(".txt")
    assert [f.suffix for f in tmp_path.glob("*.toy")] == [".toy"]  # stored under its artifact type
    again = backend.build(graph, {"cache_dir": str(tmp_path)})
    assert again.info["cache_hit"] and again.info["cache_key"] == first.info["cache_key"]
    torch.testing.assert_close(again([x, y])[0], (x + y).exp() * x.exp())


def test_a_kernel_the_backend_cannot_generate_is_an_error_without_a_host_fallback(tmp_path):
    graph = ir.parse("""
graph @t(%x: f32[3, 4]) {
  %0: f32[3, 4] = tanh(%x)
  return %0
}""")
    with pytest.raises(BackendError, match=r"kiln backend 'toy' could not generate the kernel %0 = tanh"):
        ToyBackend().build(graph, {"cache_dir": str(tmp_path)})


# ------------------------------------------------------------------ Backend.supports
def opaque_graph() -> ir.Graph:
    """A graph with a node of an op that has no implementation anywhere."""
    opaque = OpDef("test_opaque", infer=lambda types: types[0])
    graph = ir.Graph("opaque")
    x = graph.add_input("x", ir.TensorType((2, 3), ir.DType.float32))
    graph.set_outputs(graph.add_node(opaque, [x]).outputs)
    return graph


@pytest.mark.parametrize("name", ["cpu", "reference"])
def test_a_node_no_backend_can_run_is_refused_at_build_naming_op_and_shapes(name):
    graph = opaque_graph()
    backend = get_backend(name)
    assert not backend.supports(graph.nodes[0])
    with pytest.raises(BackendError, match=rf"kiln backend '{name}' cannot run %\w+ = test_opaque\(f32\[2, 3\]\).*"
                                           r"build with a backend that runs it"):
        backend.build(graph)


def test_the_cpu_backend_runs_ops_without_compute_on_the_host_and_says_so():
    graph = ir.parse("""
graph @h(%x: f32[5]) {
  %0: f32[5] = erfinv(%x)
  %1: f32[5] = tanh(%0)
  return %1
}""")
    erfinv, tanh = graph.nodes
    assert erfinv.op.compute is None and erfinv.op.reference is not None
    cpu = get_backend("cpu")
    assert cpu.supports(erfinv) and cpu.supports(tanh) and get_backend("reference").supports(erfinv)
    exe = cpu.build(graph)
    x = torch.rand(5) * 1.8 - 0.9
    torch.testing.assert_close(exe([x])[0], torch.tanh(torch.erfinv(x)))
    assert exe.info["choices"] == {"%0 = erfinv": "reference", "%1 = tanh": "generated"}
    toy = ToyBackend()  # no host reference: only what it generates
    assert toy.supports(tanh) and not toy.supports(erfinv)
    with pytest.raises(BackendError, match=r"'toy' cannot run %0 = erfinv\(f32\[5\]\)"):
        toy.build(graph)


def test_selection_follows_the_backends_library_table():
    graph = ir.parse("""
graph @s(%x: f32[4, 6], %w: f32[6, 2]) {
  %0: f32[6, 4] = permute(%x) {dims=[1, 0]}
  %1: f32[4, 2] = matmul(%x, %w)
  %2: f32[4, 2] = relu(%1)
  return %0, %2
}""")
    view, matmul, relu = graph.nodes
    with_library = Selection(lambda node: node.op_name == "matmul", host_reference=True)
    assert with_library.available(view) == ("view",)
    assert with_library.available(matmul) == ("library", "generated", "reference")
    assert with_library.rule(matmul).impl == "library" and with_library.generated(matmul).impl == "generated"
    bare = Selection(lambda node: False)
    assert bare.available(matmul) == ("generated",) and bare.rule(relu).impl == "generated"


# ------------------------------------------------------------------ the call plan's device
class CountingAllocator(TorchDeviceAllocator):
    def __init__(self, device):
        super().__init__(device)
        self.shapes = []

    def empty(self, shape, dtype):
        self.shapes.append(tuple(shape))
        return super().empty(shape, dtype)


def into(fn):
    return lambda *tensors: fn(*tensors[:-1], out=tensors[-1])


def small_plan(allocator, constant):
    """out = (x + c) ** 2 into a fresh output, x + c in the arena; a persistent slot besides."""
    return CallPlan(
        num_slots=5, num_args=1, constants={1: constant},
        planned=[SlotSpec(2, (3,), torch.float32), SlotSpec(3, (3,), torch.float32, offset=0),
                 SlotSpec(4, (3,), torch.float32, persistent=True)],
        arena_bytes=64, steps=[TorchStep(into(torch.add), (0, 1), (3,)), TorchStep(into(torch.mul), (3, 3), (2,))],
        outputs=[2], allocator=allocator)


def test_every_tensor_a_call_plan_allocates_comes_from_its_allocator():
    allocator = CountingAllocator("cpu")
    plan = small_plan(allocator, torch.ones(3))
    x = torch.arange(3.0)
    (out,) = plan([x])
    torch.testing.assert_close(out, (x + 1) ** 2)
    assert sorted(allocator.shapes) == [(3,), (3,), (64,)]  # persistent, fresh output, arena
    plan([x])
    assert sorted(allocator.shapes) == [(3,), (3,), (3,), (64,)]  # one fresh output per call
    assert HOST.device == torch.device("cpu") and plan.device == torch.device("cpu")


def test_a_call_plan_on_another_device_allocates_and_keeps_constants_there():
    allocator = CountingAllocator("meta")  # a device without memory: shapes and dtypes only
    plan = small_plan(allocator, torch.ones(3))
    assert plan.constants[1].device.type == "meta"
    (out,) = plan([torch.empty(3, device="meta")])
    assert out.device.type == "meta" and out.shape == (3,)
    assert plan.workspace().arena.device.type == "meta" and len(allocator.shapes) == 3


def test_a_fresh_output_is_written_into_the_callers_tensor_when_it_fits():
    plan = small_plan(HOST, torch.ones(3))
    x = torch.arange(3.0)
    mine = torch.full((3,), float("nan"))
    (out,) = plan([x], out={0: mine})
    assert out is mine
    torch.testing.assert_close(mine, (x + 1) ** 2)
    for wrong in (torch.empty(4), torch.empty(3, dtype=torch.float64), torch.empty(6)[::2]):
        (out,) = plan([x], out={0: wrong})  # another shape, dtype or a strided view: a fresh tensor
        assert out is not wrong
        torch.testing.assert_close(out, (x + 1) ** 2)


def test_native_kernels_run_through_the_plans_launcher():
    launcher = PythonLauncher([torch.add, torch.exp])
    plan = CallPlan(num_slots=4, num_args=2, constants={}, planned=[SlotSpec(2, (2,), torch.float32, offset=0),
                                                                   SlotSpec(3, (2,), torch.float32)],
                    arena_bytes=64, steps=[NativeRunStep(launcher, ((0, (0, 1, 2), ()), (1, (2, 3), ())))],
                    outputs=[3])
    x, y = torch.randn(2), torch.randn(2)
    torch.testing.assert_close(plan([x, y])[0], (x + y).exp())
    assert launcher.launches == 1
    (label, seconds), = plan.profile([x, y], repeat=2)
    assert label.startswith("NativeRunStep") and seconds >= 0 and launcher.launches == 3


def test_a_pack_step_rewrites_its_copy_only_when_the_weight_changes():
    writes = []

    def write(view, target):
        writes.append(1)
        target.copy_(view.T)

    plan = CallPlan(num_slots=3, num_args=1, constants={}, planned=[SlotSpec(1, (2, 3), torch.float32, persistent=True),
                                                                   SlotSpec(2, (2, 3), torch.float32)],
                    arena_bytes=0, steps=[PackStep(0, ((3, 2), (1, 3), 0), 1, write, "packed copy of %w"),
                                          TorchStep(into(torch.neg), (1,), (2,))], outputs=[2])
    w = torch.randn(2, 3)
    torch.testing.assert_close(plan([w])[0], -w)
    plan([w])
    assert len(writes) == 1
    with torch.no_grad():
        w.mul_(2)  # an in-place update: the copy follows
    torch.testing.assert_close(plan([w])[0], -w)
    assert len(writes) == 2


@pytest.mark.parametrize("name", ["reference", "cpu", "cuda", "triton"])
def test_a_backend_object_takes_its_own_option_defaults(name):
    backend_type = type(get_backend(name))
    flags = [k for k, v in backend_type.option_defaults.items() if isinstance(v, bool)]
    if flags:
        key = flags[0]
        default = backend_type.option_defaults[key]
        assert backend_type(**{key: not default}).option_defaults[key] is (not default)
        assert backend_type.option_defaults[key] is default  # the class keeps its own
    with pytest.raises(BackendError, match=rf"kiln backend '{name}' has no option\(s\) bogus"):
        backend_type(bogus=1)


class _PooledHead(torch.nn.Module):
    """conv -> global pool -> flatten -> linear: the flatten is a view of the pool's buffer,
    which must outlive the GEMM reading it."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(32, 64, 1, bias=False)
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(self.conv(x), 1), 1))


@pytest.mark.parametrize("native", ["0", "1"])
def test_a_graph_compiled_inside_inference_mode_plans_its_views_as_views(monkeypatch, native):
    """Inside ``torch.inference_mode`` torch records no view relations: a plan made there
    used to take every view for a copy, free the viewed buffer at the view and hand its
    memory to the GEMM's result, which then overwrote its own input."""
    import kiln
    from kiln.backends.common.partition import Partitioner
    from kiln.backends.cpu.standalone import ENV_VAR

    monkeypatch.setenv(ENV_VAR, native)
    torch.manual_seed(0)
    model = _PooledHead().eval()
    x = torch.randn(1, 32, 7, 7)
    plans = []
    original = Partitioner.run
    monkeypatch.setattr(Partitioner, "run", lambda self, choose: plans.append(original(self, choose)) or plans[-1])
    with torch.inference_mode():
        compiled = kiln.compile(model, (x,), backend="cpu", cache=False)
        got, want = compiled(x), model(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    flatten = [pv for plan in plans for pv in plan.values if pv.name == "2"]
    assert flatten and all(pv.origin == "view" for pv in flatten)
