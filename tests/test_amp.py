"""Automatic mixed precision: the per-op policies, the ``amp`` pass (IR before/after), cast
simplification, bf16 training accuracy and float16 dynamic loss scaling."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import kiln
from kiln.backends.reference import run_graph
from kiln.ir import DType, KilnError, get_op, parse, verify
from kiln.passes import PassManager
from kiln.passes.amp import AutoMixedPrecision, LossScaler, holds_exactly, simplify_casts

from models import mlp
from test_train import gpt2_batches, lm_loss, mlp_batches, tiny_gpt2

STEPS = 50


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def amp(text: str, dtype: str = "bf16") -> str:
    graph = parse(text)
    result = AutoMixedPrecision(dtype).run(graph)
    verify(result.graph)
    assert str(parse(str(result.graph))) == str(result.graph)
    assert str(graph) == str(parse(text)), "the pass modified its input"
    return str(result.graph)


def same(text: str) -> str:
    return str(parse(text))


# ------------------------------------------------------------------------- policies


@pytest.mark.parametrize("op, policy", [
    ("matmul", "low"), ("conv", "low"), ("scaled_dot_product_attention", "low"),
    ("softmax", "float32"), ("log_softmax", "float32"), ("sum", "float32"), ("mean", "float32"),
    ("var", "float32"), ("layer_norm", "float32"), ("rms_norm", "float32"),
    ("batch_norm", "float32"), ("exp", "float32"), ("log", "float32"), ("pow", "float32"),
    ("add", None), ("relu", None), ("gelu", None), ("reshape", None), ("embedding", None),
    ("amax", None),
])
def test_policies_are_declared_with_the_ops(op, policy):
    assert get_op(op).amp == policy


# --------------------------------------------------------------------------- the pass

MLP_BLOCK = """
graph @block(%x: f32[2, 4]) params(%w: f32[4, 3], %b: f32[3]) {
  %0: f32[2, 3] = matmul(%x, %w)
  %1: f32[2, 3] = add(%0, %b)
  %2: f32[2, 3] = relu(%1)
  %3: f32[2, 3] = softmax(%2) {dim=-1}
  %4: f32[2, 3] = matmul(%x, %w)
  return %3, %4
}
"""


def test_low_ops_cast_operands_down_and_others_follow_or_go_up():
    assert amp(MLP_BLOCK) == same("""
graph @block(%x: f32[2, 4]) params(%w: f32[4, 3], %b: f32[3]) {
  %x_bf16: bf16[2, 4] = cast(%x) {dtype=bf16}
  %w_bf16: bf16[4, 3] = cast(%w) {dtype=bf16}
  %0: bf16[2, 3] = matmul(%x_bf16, %w_bf16)
  %v0_f32: f32[2, 3] = cast(%0) {dtype=f32}
  %1: f32[2, 3] = add(%v0_f32, %b)
  %2: f32[2, 3] = relu(%1)
  %3: f32[2, 3] = softmax(%2) {dim=-1}
  %4: bf16[2, 3] = matmul(%x_bf16, %w_bf16)
  %v4: f32[2, 3] = cast(%4) {dtype=f32}
  return %3, %v4
}
""")


def test_follow_ops_keep_low_precision_and_float32_ops_cast_up():
    text = """
graph @g(%x: f32[2, 4], %w: f32[4, 4]) {
  %0: f32[2, 4] = matmul(%x, %w)
  %1: f32[2, 4] = gelu(%0)
  %2: f32[2, 4] = log_softmax(%1) {dim=-1}
  %3: f32[] = sum(%2)
  return %3
}
"""
    assert amp(text, "f16") == same("""
graph @g(%x: f32[2, 4], %w: f32[4, 4]) {
  %x_f16: f16[2, 4] = cast(%x) {dtype=f16}
  %w_f16: f16[4, 4] = cast(%w) {dtype=f16}
  %0: f16[2, 4] = matmul(%x_f16, %w_f16)
  %1: f16[2, 4] = gelu(%0)
  %v1_f32: f32[2, 4] = cast(%1) {dtype=f32}
  %2: f32[2, 4] = log_softmax(%v1_f32) {dim=-1}
  %3: f32[] = sum(%2)
  return %3
}
""")


def test_follow_ops_mixing_f16_and_bf16_compute_in_f32_and_f64_is_never_lowered():
    text = """
graph @g(%a: f16[3], %b: bf16[3], %c: f64[3, 3]) {
  %0: f32[3] = add(%a, %b)
  %1: f64[3] = matmul(%c, %0)
  return %1
}
"""
    graph = parse(text.replace("%1: f64[3] = matmul(%c, %0)", "%x: f64[3] = cast(%0) {dtype=f64}\n"
                               "  %1: f64[3] = matmul(%c, %x)"))
    result = AutoMixedPrecision("bf16").run(graph).graph
    kinds = [(n.op_name, n.outputs[0].dtype) for n in result.nodes]
    assert ("add", DType.float32) in kinds and ("matmul", DType.float64) in kinds
    assert sum(1 for n in result.nodes if n.op_name == "cast") == 3  # a->f32, b->f32, explicit f64


def test_pass_is_idempotent_keeps_the_signature_and_stays_close():
    graph = parse(MLP_BLOCK)
    once = AutoMixedPrecision("bf16").run(graph)
    assert once.changed
    assert [v.type for v in once.graph.inputs + once.graph.params + once.graph.outputs] == \
        [v.type for v in graph.inputs + graph.params + graph.outputs]
    twice = AutoMixedPrecision("bf16").run(once.graph)
    assert not twice.changed and twice.graph is once.graph
    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal(v.type.shape).astype(np.float32) for v in graph.inputs]
    params = [rng.standard_normal(v.type.shape).astype(np.float32) for v in graph.params]
    want = run_graph(graph, feeds, params)
    got = run_graph(once.graph, feeds, params)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=3e-2, atol=3e-2)
        assert not np.array_equal(g, w)  # it did compute in bf16


def test_graph_without_low_ops_is_unchanged():
    text = """
graph @g(%x: f32[4]) {
  %0: f32[4] = exp(%x)
  %1: f32[] = sum(%0)
  return %1
}
"""
    graph = parse(text)
    result = AutoMixedPrecision("bf16").run(graph)
    assert not result.changed and result.graph is graph


def test_pipeline_text_and_bad_dtype():
    pm = PassManager("amp{dtype=f16},dce")
    assert pm.spec() == "amp{dtype=f16},dce"
    assert "f16[2, 3] = matmul" in str(pm.run(parse(MLP_BLOCK)).graph)
    with pytest.raises(KilnError, match=r"unknown low-precision dtype 'f8'"):
        AutoMixedPrecision("f8").run(parse(MLP_BLOCK))


# ------------------------------------------------------------------- cast simplification


def test_exact_cast_chains_and_no_op_casts_are_removed_but_roundings_kept():
    text = """
graph @c(%x: bf16[2], %y: f32[2]) {
  %0: f32[2] = cast(%x) {dtype=f32}
  %1: bf16[2] = cast(%0) {dtype=bf16}
  %2: f16[2] = cast(%y) {dtype=f16}
  %3: f32[2] = cast(%2) {dtype=f32}
  %4: f32[2] = cast(%y) {dtype=f32}
  %5: f64[2] = cast(%0) {dtype=f64}
  %6: f32[2] = cast(%x) {dtype=f32}
  %7: f16[2] = cast(%6) {dtype=f16}
  return %1, %3, %4, %5, %7
}
"""
    assert str(simplify_casts(parse(text))) == same("""
graph @c(%x: bf16[2], %y: f32[2]) {
  %2: f16[2] = cast(%y) {dtype=f16}
  %3: f32[2] = cast(%2) {dtype=f32}
  %5: f64[2] = cast(%x) {dtype=f64}
  %7: f16[2] = cast(%x) {dtype=f16}
  return %x, %3, %y, %5, %7
}
""")


@pytest.mark.parametrize("src, dst, exact", [
    (DType.bfloat16, DType.float32, True), (DType.float16, DType.float32, True),
    (DType.float32, DType.float64, True), (DType.float32, DType.float16, False),
    (DType.float16, DType.bfloat16, False), (DType.bfloat16, DType.float16, False),
    (DType.int32, DType.float32, False),
])
def test_holds_exactly(src, dst, exact):
    assert holds_exactly(src, dst) is exact


# ----------------------------------------------------------------------- training


def final_loss(model, loss_fn, batches, amp_dtype=None) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = kiln.compile_train(model, loss_fn, optimizer, batches[0], amp=amp_dtype)
    for x, y in batches:
        loss = step(x, y).item()
    return loss


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_bf16_training_reaches_float32_loss(name):
    build, loss_fn, batches = {
        "mlp": (mlp, nn.functional.mse_loss, mlp_batches(STEPS)),
        "gpt2": (tiny_gpt2, lm_loss, gpt2_batches(STEPS)),
    }[name]
    full = final_loss(build(), loss_fn, batches)
    model = build()
    master = {n: p.dtype for n, p in model.named_parameters()}
    low = final_loss(model, loss_fn, batches, "bfloat16")
    assert abs(low - full) <= 0.02 * full, f"bf16 {low} vs f32 {full}"
    assert {n: p.dtype for n, p in model.named_parameters()} == master  # float32 master weights


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
def test_float16_loss_scaling_skips_an_overflowing_step_and_halves_the_scale():
    batches = mlp_batches(8)
    clean_model = mlp()
    model = copy.deepcopy(clean_model)
    clean_opt = torch.optim.AdamW(clean_model.parameters(), lr=3e-3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    clean = kiln.compile_train(clean_model, nn.functional.mse_loss, clean_opt, batches[0], amp="float16")
    step = kiln.compile_train(model, nn.functional.mse_loss, optimizer, batches[0], amp="float16")
    assert step.loss_scale == 2.0 ** 16
    for x, y in batches[:3]:
        clean(x, y)
        step(x, y)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in optimizer.state[model.fc1.weight].items()}
    x, y = batches[3]
    step(x * 1e5, y)  # f16 activations overflow: inf/NaN gradients
    assert step.loss_scale == 2.0 ** 15 and step.skipped_steps == 1
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), f"{n} changed on a skipped step"
    for k, v in optimizer.state[model.fc1.weight].items():
        assert torch.equal(v, state[k]), f"state {k} changed on a skipped step"
    assert optimizer.state[model.fc1.weight]["step"].item() == 3.0
    for x, y in batches[3:]:  # training goes on as if the bad batch had never come
        want = clean(x, y).item()
        got = step(x, y).item()
        assert np.isfinite(got) and got == pytest.approx(want, rel=1e-3)


def test_loss_scaler_follows_grad_scaler_rules():
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(False)
    assert scaler.scale == 16.0 and scaler.growth_tracker == 0
    scaler.update(False)
    scaler.update(True)
    assert scaler.scale == 8.0 and scaler.growth_tracker == 0 and scaler.skipped_steps == 1
    defaults = torch.amp.GradScaler("cpu")
    assert LossScaler().scale == defaults.get_scale()
    assert LossScaler().growth_interval == defaults.get_growth_interval()
    with pytest.raises(KilnError, match="backoff_factor"):
        LossScaler(backoff_factor=2.0)


# ----------------------------------------------------------------------- the cpu backend
@pytest.mark.parametrize("amp_dtype", ["bfloat16", "float16"])
def test_cpu_amp_inference_runs_in_c_with_cached_weight_casts(amp_dtype):
    """On the cpu backend a mixed-precision model runs no numpy fallback, its float32 weights
    are converted once into persistent copies (plan ``pack`` steps), and an in-place update
    of a weight is seen at the next call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.LayerNorm(48), nn.Linear(48, 7)).eval()
    x = torch.randn(5, 24)
    compiled = kiln.compile(model, (x,), backend="cpu", amp=amp_dtype, strict=True)
    assert not compiled.executable.info["fallbacks"]
    steps = " ".join(str(s) for s in compiled.executable.plan.steps)
    short = "bf16" if amp_dtype == "bfloat16" else "f16"
    assert steps.count(f"{short} copy of") >= 2, steps  # the two Linear weights
    tol = 3e-2 if amp_dtype == "bfloat16" else 5e-3
    with torch.no_grad():
        for _ in range(2):
            want = model(x)
            got = compiled(x).float()
            assert ((got - want).abs().max() / want.abs().max()).item() <= tol
            model[0].weight.mul_(-1.5)  # the next call must convert the weight again
