"""PyTorch capture (ATen -> kiln graph) and the reference executor, against PyTorch eager."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

import kiln.ir
from kiln.backends.reference import run_graph
from kiln.frontends.torch.aten import kiln_dtype
from kiln.frontends.torch.capture import (
    Captured,
    capture,
    capture_fx,
    capture_program,
    decomposition_table,
    export_program,
    is_supported,
    is_undecomposed,
    lowering_blockers,
)
from kiln.frontends.errors import CaptureError, UnsupportedOpError
from kiln.ir import DType, Graph, KilnError, TensorType

from models import MODELS

REL_TOL = 1e-4


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def rel_err(got: np.ndarray, want: torch.Tensor) -> float:
    want = want.detach().double().numpy()
    scale = max(float(np.abs(want).max()), 1e-12)
    return float(np.abs(got.astype(np.float64) - want).max()) / scale


def run_captured(c: Captured, args: tuple, kwargs: dict, *, float64: bool = False) -> list[np.ndarray]:
    flat = pytree.tree_leaves((args, kwargs))
    inputs = [to_numpy(flat[i]) for i in c.input_positions]
    params = [to_numpy(t) for t in c.params.values()]
    return run_graph(c.graph, inputs, params, float64=float64)


@pytest.fixture(scope="module", params=list(MODELS))
def model_case(request):
    builder, inputs_fn = MODELS[request.param]
    model = builder()
    args, kwargs = inputs_fn()
    program = export_program(model, args, kwargs)
    captured = capture_program(program)
    with torch.no_grad():
        expected = model(*args, **kwargs)
    return request.param, model, args, kwargs, captured, expected, program


def test_models_are_lowered_without_decomposition(model_case):
    """kiln lowers the exported training IR of every test model as it is (no re-trace)."""
    name, program = model_case[0], model_case[6]
    assert is_undecomposed(program), f"{name}: {lowering_blockers(program)}"
    assert not lowering_blockers(program)


def test_models_match_eager(model_case):
    name, _, args, kwargs, captured, expected, _ = model_case
    outputs = run_captured(captured, args, kwargs)
    flat_expected, spec = pytree.tree_flatten(expected)
    assert len(outputs) == len(flat_expected)
    for i, (got, want) in enumerate(zip(outputs, flat_expected)):
        assert got.shape == tuple(want.shape), f"{name} output {i}"
        assert DType.from_numpy(got.dtype) == kiln_dtype(want.dtype)
        assert rel_err(got, want) <= REL_TOL, f"{name} output {i}: rel err {rel_err(got, want)}"
    rebuilt = pytree.tree_unflatten([torch.from_numpy(o) for o in outputs], captured.out_spec)
    assert type(rebuilt) is type(expected)
    assert pytree.tree_structure(rebuilt) == spec


class WithConstants(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
        self.register_buffer("offset", torch.tensor([0.5, 0.25, 0.125]), persistent=False)
        self.table = torch.tensor([10.0, 20.0, 30.0])  # neither parameter nor buffer: lifted

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x * self.scale * n + self.offset + self.table


def test_parameters_buffers_and_lifted_constants():
    model = WithConstants()
    args = (torch.randn(2, 3), 4)
    captured = capture(model, args)
    assert list(captured.params) == ["scale", "offset"]
    assert captured.params["scale"] is model.scale and captured.params["offset"] is model.offset
    assert [v.name for v in captured.graph.inputs] == captured.input_names == ["x"]
    assert captured.input_positions == [0]
    assert any(c.data.tolist() == [10.0, 20.0, 30.0] for c in captured.graph.constants)
    (got,) = run_captured(captured, args, {})
    assert rel_err(got, model(*args)) <= REL_TOL


def test_models_text_round_trip_and_verify(model_case):
    captured = model_case[4]
    text = str(captured.graph)
    assert str(kiln.ir.parse(text)) == text
    kiln.ir.verify(captured.graph)


def test_models_params_are_referenced_not_copied(model_case):
    name, model, _, _, captured, _, _ = model_case
    live = dict(model.named_parameters(remove_duplicate=False))
    live.update(model.named_buffers(remove_duplicate=False))
    assert [v.name for v in captured.graph.params] == list(captured.params)
    for param_name, tensor in captured.params.items():
        assert tensor is live[param_name], f"{name}: {param_name} is not the model's tensor"
    assert captured.params, f"{name} has no params"


def test_models_nodes_have_source_locations(model_case):
    name, _, _, _, captured, _, _ = model_case
    loc_re = re.compile(r"^[\w.]+\.py:\d+ in \w+: \S")
    for node in captured.graph.nodes:
        assert node.loc and loc_re.match(node.loc), f"{name}: node {node!r} has loc {node.loc!r}"
    if name in ("mlp", "resnet18", "cnn"):
        assert any(n.loc.startswith("models.py:") for n in captured.graph.nodes)


def test_models_float64_oracle(model_case):
    name, model, args, kwargs, captured, expected, _ = model_case
    outputs = run_captured(captured, args, kwargs, float64=True)
    for got, want in zip(outputs, pytree.tree_leaves(expected)):
        if want.dtype.is_floating_point:
            assert got.dtype == np.float64
            assert rel_err(got, want) <= REL_TOL, name


def test_float64_oracle_computes_in_float64():
    builder, inputs_fn = MODELS["mlp"]
    model = builder()
    args, _ = inputs_fn()
    captured = capture(model, args)
    oracle = run_captured(captured, args, {}, float64=True)[0]
    plain = run_captured(captured, args, {})[0]
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(args[0].double())
    # float32 arithmetic differs from the float64 model by ~1e-7 relative.
    assert rel_err(oracle, exact) < 1e-12
    assert rel_err(plain, exact) > 1e-10


@torch.library.custom_op("kiln_test::window", mutates_args=())
def _window(x: torch.Tensor, step: int) -> torch.Tensor:
    """A user's custom op: kiln has no rule for it (nor can it ever, without one)."""
    return x[:, ::step].clone()


@_window.register_fake
def _(x: torch.Tensor, step: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], (x.shape[1] + step - 1) // step))


class Unfolds(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kiln_test.window(x, 2) * 2


def test_unsupported_op_names_op_types_and_source_line():
    with pytest.raises(UnsupportedOpError) as info:
        capture(Unfolds(), (torch.randn(2, 8),))
    err = info.value
    assert err.op == "kiln_test.window.default"
    assert err.input_types == "f32[2, 8], 2"
    assert re.fullmatch(r"test_capture\.py:\d+ in forward: return torch\.ops\.kiln_test\.window\(x, 2\) \* 2",
                        err.source)
    assert re.search(r"kiln_test\.window\.default\(f32\[2, 8\], 2\).*\n  at test_capture\.py:\d+ "
                     r"in forward: .*\n.*torch\.compile\(model, backend='kiln'\)", str(err))
    ep = export_program(Unfolds(), (torch.randn(2, 8),))
    support = {n.name: is_supported(n) for n in ep.graph.nodes}
    assert support["window"] is False
    assert support["mul"] is True and support["x"] is True


def test_attribute_conditions_make_ops_unsupported():
    # The same ATen op is supported or not depending on its arguments: sparse gradients
    # are refused, dense ones lowered.
    sparse = torch.nn.Embedding(10, 4, sparse=True)
    with pytest.raises(UnsupportedOpError, match=r"aten\.embedding\.default\(f32\[10, 4\], i64\[1, 2\].*"
                                                 r"sparse=True"):
        capture(sparse, (torch.tensor([[1, 2]]),))
    ep = export_program(sparse, (torch.tensor([[1, 2]]),))
    lookup = next(n for n in ep.graph.nodes if "embedding" in str(n.target))
    assert not is_supported(lookup)
    dense = export_program(torch.nn.Embedding(10, 4), (torch.tensor([[1, 2]]),))
    assert is_supported(next(n for n in dense.graph.nodes if "embedding" in str(n.target)))


def test_dynamic_shapes_capture_symbolically_but_unsupported_ops_are_still_refused():
    dim = {"x": {0: torch.export.Dim("batch")}}
    ep = torch.export.export(Relu(), (torch.randn(4, 8),), dynamic_shapes=dim)
    graph = capture_program(ep.run_decompositions(decomposition_table())).graph
    assert str(graph.inputs[0].type) == "f32[s0, 8]" or not graph.inputs[0].type.is_static
    ep = torch.export.export(Unfolds(), (torch.randn(4, 8),), dynamic_shapes=dim)
    with pytest.raises(UnsupportedOpError, match=r"kiln_test.window"):
        capture_program(ep.run_decompositions(decomposition_table()))


class Relu(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


def test_lowering_with_wrong_shape_is_reported_as_kiln_bug(monkeypatch):
    from kiln.frontends.torch import aten as aten_table

    wrong = aten_table.AtenRule(lambda ctx, x: ctx.op("sum", x))
    monkeypatch.setitem(aten_table.ATEN_TABLE, torch.ops.aten.relu.default, wrong)
    with pytest.raises(CaptureError, match=r"aten\.relu\.default\(f32\[2, 3\]\) has type f32\[\], "
                                           r"but PyTorch computes f32\[2, 3\]\n  at test_capture\.py:\d+"):
        capture(Relu(), (torch.randn(2, 3),))


class Promotions(torch.nn.Module):
    def forward(self, i64, i32, f16, flags):
        return (i64 * 0.5, i32 + 3, f16 * 0.5, flags + 1, i64 / 2, i64 // 2, i32 ** 2,
                i64 > 1.5, f16 + i32, torch.where(flags, i32, 2.5), 1 - i32, i64.float() * 2,
                torch.full_like(i32, 7), torch.arange(5) * 1.5, f16 * 1e5, f16 * 0.1)


def test_scalar_promotion_matches_torch():
    args = (torch.tensor([1, 2, 3]), torch.tensor([4, -5, 6], dtype=torch.int32),
            torch.tensor([0.5, 1.5e-3, -2e-4], dtype=torch.float16), torch.tensor([True, False, True]))
    captured = capture(Promotions(), args)
    outputs = run_captured(captured, args, {})
    for i, (got, want) in enumerate(zip(outputs, Promotions()(*args))):
        assert got.dtype == to_numpy(want).dtype, f"output {i}: {got.dtype} vs {want.dtype}"
        assert captured.graph.outputs[i].dtype == kiln_dtype(want.dtype)
        np.testing.assert_array_equal(got, to_numpy(want), err_msg=f"output {i}")


class KitchenSink(torch.nn.Module):
    """Layout, indexing, reduction and math ops that show up in transformer code."""

    def forward(self, x, idx, mask):
        values, indices = x.max(dim=-1)
        a, b = x.chunk(2, dim=1)
        stacked = torch.stack([a, b], dim=0).sum(0)
        spread = x.var(dim=1, keepdim=True) + x.std(dim=0)
        masked = x.masked_fill(mask, -1.0)
        tri = torch.tril(x[:, :4]) + torch.triu(x[:, :4], diagonal=1).flip(0)
        repeated = x.repeat(1, 2)[:, ::3]
        gathered = torch.gather(x, 1, idx) + torch.index_select(x, 0, idx[:, 0])[:, :2]
        padded = F.pad(x, (1, 2), value=0.5)
        args = x.argmax(dim=1) + x.argmin(dim=0).sum()
        logic = (x > 0).any(dim=1) & (x < 3).all(dim=1)
        probs = F.softmax(x, -1) + F.log_softmax(x, 0)
        clipped = torch.where(x > 0, x, 0.0).clamp(-0.5, 0.5) + (1 - x).abs()
        math = torch.erf(x) + torch.rsqrt(x.abs() + 1) + torch.sin(x) * torch.cos(x)
        buckets = torch.div(idx, 2, rounding_mode="floor") + idx % 3 + torch.minimum(idx, idx.flip(0))
        rel = torch.log(x.abs().float() / 4 + 1) / np.log(2.0) * 8
        q = x.reshape(1, 2, 6, 4)
        attn = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        attn_masked = F.scaled_dot_product_attention(q, q, q, attn_mask=torch.tril(torch.ones(6, 6)))
        cums = torch.cumsum(x, dim=1) + x.mean() + x.amax(dim=(0, 1)) * x.prod(dim=0)
        picked = x[:, idx[:, 0]] + x[idx[:, 1]][:, :6]
        return (values, indices, stacked, spread, masked, tri, repeated, gathered, padded, args,
                logic, probs, clipped, math, buckets, rel.to(torch.int64), attn, attn_masked, cums,
                picked)


def test_kitchen_sink_matches_eager():
    torch.manual_seed(0)
    args = (torch.randn(6, 8), torch.randint(0, 6, (6, 2)), torch.rand(6, 8) > 0.5)
    captured = capture(KitchenSink(), args)
    outputs = run_captured(captured, args, {})
    for i, (got, want) in enumerate(zip(outputs, KitchenSink()(*args))):
        assert got.dtype == to_numpy(want).dtype and got.shape == tuple(want.shape), f"output {i}"
        assert rel_err(got, want) <= REL_TOL, f"output {i}"


def _layer_norm_stats(x, w, b):
    y, mean, rstd = torch.ops.aten.native_layer_norm(x, [8], w, b, 1e-5)
    return y * 2, mean, rstd, F.linear(x, w.expand(3, 8))


@pytest.mark.parametrize("drop_meta", [False, True])
def test_capture_fx_with_params(drop_meta):
    args = [torch.randn(4, 8), torch.randn(8), torch.randn(8)]
    gm = make_fx(_layer_norm_stats, decomposition_table=decomposition_table())(*args)
    if drop_meta:  # capture_fx propagates the example inputs itself
        for node in gm.graph.nodes:
            node.meta.pop("val", None)
    captured = capture_fx(gm, args, param_indices={1, 2})
    assert [v.name for v in captured.graph.inputs] == captured.input_names and captured.input_positions == [0]
    assert captured.params[captured.graph.params[0].name] is args[1]
    outputs = run_graph(captured.graph, [to_numpy(args[0])], [to_numpy(args[1]), to_numpy(args[2])])
    for got, want in zip(outputs, _layer_norm_stats(*args)):
        assert got.shape == tuple(want.shape) and rel_err(got, want) <= REL_TOL


def _with_dead_code(x):
    torch.ops.kiln_test.window(x.reshape(1, 4), 2)  # unsupported, but its result is never used
    return x.relu()


def test_capture_fx_skips_dead_code():
    gm = make_fx(_with_dead_code)(torch.randn(4))
    assert any("window" in str(n.target) for n in gm.graph.nodes)
    assert capture_fx(gm, [torch.randn(4)]).graph.op_histogram() == {"relu": 1}


def test_capture_fx_rejects_non_tensor_outputs():
    gm = make_fx(lambda x: (x * 2, None))(torch.randn(3))
    with pytest.raises(UnsupportedOpError, match=r"output 1 is None, not a tensor"):
        capture_fx(gm, [torch.randn(3)])


def test_run_graph_checks_inputs_and_result_shapes():
    g = Graph("t")
    x = g.add_input("x", TensorType((2, 3), DType.float32))
    y = g.op("relu", x)
    g.set_outputs([y])
    with pytest.raises(KilnError, match=r"input %x expects f32\[2, 3\] but got an array of shape \(3, 2\)"):
        run_graph(g, [np.zeros((3, 2), np.float32)], [])
    with pytest.raises(KilnError, match=r"expects f32\[2, 3\] but got dtype float64"):
        run_graph(g, [np.zeros((2, 3))], [])
    y.type = TensorType((3, 2), DType.float32)  # simulate a wrong inference rule
    with pytest.raises(KilnError, match=r"kiln bug: node %\w+ = relu\(\.\.\.\) produced shape \(2, 3\)"):
        run_graph(g, [np.zeros((2, 3), np.float32)], [])


def test_decomposition_table_keeps_high_level_ops():
    table = decomposition_table()
    aten = torch.ops.aten
    for op in (aten.linear.default, aten.layer_norm.default, aten.scaled_dot_product_attention.default,
               aten.softmax.int, aten.silu.default, aten.matmul.default):
        assert op not in table
    assert aten.addcmul.default in table or aten.hardswish.default in table


# In-place calls of the training IR: lowered functionally only where nothing can tell.
class InplaceOnFresh(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = torch.relu_(self.lin(x))
        h += x  # add_ on relu_'s result: a chain of in-place calls on one fresh tensor
        return h * 2


class InplaceThenOriginalUsed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.lin(x)
        torch.relu_(h)  # result unused: export rewires the later read of h to relu_'s result
        return h + 1


class InplaceThroughEvalDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        h = self.lin(x)
        torch.relu_(self.drop(h))  # eval-mode dropout returns h itself: h is written
        return h * 2


class InplaceAfterView(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.lin(x)
        flat = h.view(-1)
        torch.relu_(h)
        return flat + 0


class InplaceOnInput(torch.nn.Module):
    def forward(self, x):
        y = x.mul_(2)
        return y + 1


# name: (model, lowered without decomposition, the decomposed program equals eager)
INPLACE_CASES = {
    "fresh_chain": (InplaceOnFresh, True, True),
    "original_used_after": (InplaceThenOriginalUsed, True, True),
    # PyTorch's functionalization traces eval dropout as a copy, so the decomposed program
    # misses this write as well; kiln only has to refuse to lower it whole.
    "through_eval_dropout": (InplaceThroughEvalDropout, False, False),
    "after_view": (InplaceAfterView, False, True),
    "on_input": (InplaceOnInput, False, False),
}


@pytest.mark.parametrize("case", list(INPLACE_CASES))
def test_inplace_calls_keep_eager_semantics(case):
    """Safe in-place calls are lowered without decomposition; unsafe ones (a write through
    or to an alias, or to a user input) send the program through the decomposition."""
    make, lowered_whole, matches_eager = INPLACE_CASES[case]
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(3, 6)
    program = export_program(model, (x.clone(),))
    assert is_undecomposed(program) is lowered_whole, lowering_blockers(program)
    if not matches_eager:
        return
    (got,) = run_captured(capture_program(program), (x.clone(),), {})
    with torch.no_grad():
        want = model(x.clone())
    assert rel_err(got, want) <= REL_TOL


def test_inplace_write_to_an_input_becomes_an_input_update_output():
    program = export_program(InplaceOnInput(), (torch.randn(3, 6),))
    graph = capture_program(program).graph
    assert [v.name for v in graph.outputs][-1] == "input_update.x"  # written back after each call


class TrainingIrOps(torch.nn.Module):
    """Ops that appear in the un-decomposed IR of transformers' mask code."""

    def forward(self, x, flags):
        first = torch.diff(x, dim=1, prepend=x[:, :1] - 1)
        second = torch.diff(x, n=2, dim=0, append=x[:1])
        both = (x > 0) & flags | (x < -1) ^ flags
        return first, second, both, torch.diff(flags.int(), dim=1), torch.diff(flags, dim=0)


def test_training_ir_ops_match_eager():
    torch.manual_seed(0)
    args = (torch.randn(4, 5), torch.rand(4, 5) > 0.5)
    program = export_program(TrainingIrOps(), args)
    assert is_undecomposed(program)
    targets = {str(n.target) for n in program.graph.nodes}
    assert {"aten.diff.default", "aten.__and__.Tensor"} <= targets
    outputs = run_captured(capture_program(program), args, {})
    for got, want in zip(outputs, TrainingIrOps()(*args)):
        np.testing.assert_array_equal(got, to_numpy(want))


def test_decompose_true_gives_the_core_aten_program():
    program = export_program(InplaceOnFresh().eval(), (torch.randn(3, 6),), decompose=True)
    assert not is_undecomposed(program)
    targets = {str(n.target) for n in program.graph.nodes}
    assert "aten.relu_.default" not in targets and "aten.relu.default" in targets


_V = torch.linspace(-2.0, 2.5, 24).reshape(4, 6)
_IMG = torch.linspace(-1.0, 1.0, 2 * 3 * 6 * 6).reshape(2, 3, 6, 6).sin()
_INTS = torch.arange(-5, 5)
aten = torch.ops.aten

# ATen calls traced one by one with make_fx (no decomposition): each exercises one rule.
DIRECT_ATEN_CASES = {
    "leaky_relu": (lambda a: aten.leaky_relu(a, 0.2), (_V,)),
    "hardtanh": (lambda a: aten.hardtanh(a, -0.5, 0.7), (_V,)),
    "clamp_tensor_bound": (lambda a, b: aten.clamp(a, b, None), (_V, torch.zeros(6))),
    "clamp_int_tensor_float_bounds": (lambda a: aten.clamp(a, 0.5, 2), (_INTS,)),
    "narrow_negative": (lambda a: aten.narrow(a, 1, -4, 2), (_V,)),
    "unbind": (lambda a: aten.unbind(a, 1)[2], (_V,)),
    "copy_broadcast_cast": (lambda a, b: aten.copy(a, b), (_V, torch.arange(6))),
    "new_full": (lambda a: aten.new_full(a, [2, 3], 1.5), (_V,)),
    "safe_softmax_all_masked_row": (
        lambda a: aten._safe_softmax(a.masked_fill(a > 0.5, float("-inf")), -1),
        (torch.tensor([[1.0, 2.0], [-3.0, 0.25]]),)),
    "var_mean": (lambda a: aten.var_mean.correction(a, [1], correction=0, keepdim=True), (_V,)),
    "round_decimals": (lambda a: aten.round.decimals(a, decimals=1), (_V * 1.37,)),
    "where_two_scalars": (lambda a: aten.where.Scalar(a > 0, 1.0, 0.0), (_V,)),
    "to_other": (lambda a, b: aten.to.other(a, b), (_V, torch.zeros(1, dtype=torch.float64))),
    "batch_norm_no_affine": (
        lambda a, m, s: aten.batch_norm(a, None, None, m, s, False, 0.1, 1e-5, False),
        (_IMG, torch.tensor([0.1, -0.2, 0.3]), torch.tensor([0.5, 1.0, 1.5]))),
    "upsample_nearest_uneven": (lambda a: aten.upsample_nearest2d.default(a, [12, 9]), (_IMG,)),
    "upsample_bilinear_align": (lambda a: aten.upsample_bilinear2d.default(a, [12, 9], True), (_IMG,)),
    "upsample_bilinear_scale": (lambda a: aten.upsample_bilinear2d.vec(a, None, False, [2.0, 2.0]),
                                (_IMG,)),
    "max_pool_unbatched_ceil": (lambda a: aten.max_pool2d(a[0], [3, 3], [2, 2], [1, 1], [1, 1], True),
                                (_IMG,)),
    "conv1d_strided": (lambda a, w: aten.convolution(a, w, None, [2], [1], [1], False, [0], 1),
                       (torch.randn(1, 4, 9), torch.randn(6, 4, 3))),
    "avg_pool_divisor": (lambda a: aten.avg_pool2d(a, [3, 3], [2, 2], [1, 1], False, False, 5), (_IMG,)),
    "adaptive_avg_pool_uneven": (lambda a: aten._adaptive_avg_pool2d(a, [4, 5]), (_IMG,)),
    "sdpa_flash_cpu_causal": (
        lambda q: aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True)[0],
        (torch.randn(1, 2, 5, 4),)),
    "baddbmm_scaled": (lambda b, a, c: aten.baddbmm(b, a, c, beta=0.5, alpha=2.0),
                       (torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5))),
    "addmm_beta0_ignores_nan_bias": (lambda b, a, c: aten.addmm(b, a, c, beta=0),
                                     (torch.full((3, 5), float("nan")), torch.randn(3, 4),
                                      torch.randn(4, 5))),
    "prod_int32_promotes": (lambda a: aten.prod.default(a), (torch.arange(1, 5, dtype=torch.int32),)),
    "sum_int32_promotes": (lambda a: aten.sum.dim_IntList(a, [0]), (torch.arange(1, 5, dtype=torch.int32),)),
    "bf16_linear": (lambda a, w: aten.linear(a, w), (_V.bfloat16(), torch.randn(3, 6).bfloat16())),
    "pow_scalar_base": (lambda a: aten.pow.Scalar(2, a), (_V,)),
    "rsub_alpha": (lambda a: aten.rsub.Scalar(a, 1.0, 2), (_V,)),
    "sub_alpha": (lambda a, b: aten.sub.Tensor(a, b, alpha=3), (_V, _V.flip(0))),
    "native_dropout_eval_mask": (lambda a: aten.native_dropout(a, 0.5, False)[1], (_V,)),
    "min_dim_indices": (lambda a: aten.min.dim(a, 0)[1] + aten.max.default(a), (_V.cos(),)),
    "index_with_none": (lambda a, i: aten.index.Tensor(a, [None, i]), (_V, torch.tensor([[0, 5], [2, 2]]))),
    "split_negative_dim": (lambda a: aten.split_with_sizes(a, [1, 2, 3], -1)[1], (_V,)),
    "cat_legacy_empty": (lambda a: aten.cat([a, torch.zeros(0)], 0), (_V,)),
    "arange_float_steps": (lambda: aten.arange.start_step(0.5, 3.2, 0.7), ()),
    "full_bool": (lambda: aten.full([2], 1, dtype=torch.bool), ()),
    "std_correction": (lambda a: aten.std.correction(a, None, correction=2), (_V,)),
    "pad_negative": (lambda a: aten.constant_pad_nd(a, [-1, 2, 1, 0], 3.0), (_V,)),
    "cumsum_dtype": (lambda a: aten.cumsum(a, 0, dtype=torch.float64), (torch.arange(5),)),
    "log_softmax_dtype": (lambda a: aten.log_softmax.int(a, 0, torch.float64), (_V,)),
    "gelu_tanh": (lambda a: aten.gelu(a, approximate="tanh"), (_V,)),
    "masked_fill_tensor_value": (lambda a: aten.masked_fill.Tensor(a, a > 0, torch.tensor(2)), (_V,)),
    "div_trunc_ints": (lambda a: aten.div.Tensor_mode(a, 3, rounding_mode="trunc"), (_INTS,)),
    "remainder_negative": (lambda a: aten.remainder.Scalar(a, -3), (_INTS,)),
    "slice_negative_step2": (lambda a: aten.slice.Tensor(a, 1, -5, None, 2), (_V,)),
    "expand_new_dim": (lambda a: aten.expand(a[0], [3, -1]), (_V,)),
}


def _numpy_any(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(DType.bfloat16.numpy)
    return t.numpy()


@pytest.mark.parametrize("case", list(DIRECT_ATEN_CASES))
def test_direct_aten_ops_match_torch(case):
    fn, args = DIRECT_ATEN_CASES[case]
    captured = capture_fx(make_fx(fn)(*args), list(args))
    outputs = run_graph(captured.graph, [_numpy_any(a) for a in args], [])
    wants = pytree.tree_leaves(fn(*args))
    assert len(outputs) == len(wants)
    for got, want in zip(outputs, wants):
        assert got.shape == tuple(want.shape)
        assert got.dtype == _numpy_any(want).dtype
        tol = 1e-2 if want.dtype == torch.bfloat16 else REL_TOL
        want64 = want.double().numpy()
        scale = max(1.0, float(np.nanmax(np.abs(want64), initial=0)))
        np.testing.assert_allclose(got.astype(np.float64), want64, rtol=tol, atol=tol * scale)
