"""Dynamic shapes from capture to the compiled call: torch.export ``Dim``s and torch.compile's
dynamic graphs become symbolic kiln sizes with ranges, inference and passes keep them, and
every call checks its sizes before running."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import sympy
import torch
from torch.export import Dim

import kiln
from kiln.frontends.torch import capture as capture_mod
from kiln.frontends.torch.capture_cache import CaptureCache
from kiln.frontends.torch.fallback import KilnFallbackWarning
from kiln.frontends.torch.symbolic import kiln_expr, naming
from kiln.ir import Graph, DType, SymDim, TensorType, parse, verify
from kiln.ir.sizes import SizeError, specialize
from kiln.passes.manager import PassManager
from kiln.passes.pipeline import resolve_passes
from kiln.backends import get_backend


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(3, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).reshape(x.shape[0] * 2, 2)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def test_mlp_with_a_batch_dim_compiles_once_and_checks_its_range():
    model = MLP().eval()
    compiled = kiln.compile(model, (torch.randn(4, 3),), backend="reference", cache=False,
                            dynamic_shapes={"x": {0: Dim("batch", min=2, max=64)}})
    graph = compiled.graph
    assert str(graph.inputs[0].type) == "f32[batch, 3]"
    assert str(graph.outputs[0].type) == "f32[2*batch, 2]"
    assert graph.sizes["batch"].lo == 2 and graph.sizes["batch"].hi == 64
    verify(graph)
    assert str(parse(str(graph))) == str(graph)
    ref = get_backend("reference")
    params = [p for p in compiled.params]
    with torch.no_grad():
        for batch in (2, 7, 64):
            x = torch.randn(batch, 3)
            want = model(x)
            assert _rel(compiled(x), want) <= 1e-4
            static = ref.build(specialize(graph, {"batch": batch}), {})  # the static oracle
            assert _rel(static([x, *params])[0], want) <= 1e-4
        with pytest.raises(SizeError, match=r"size batch = 65 is outside its range \[2, 64\].*input 0 \('x'\) axis 0"):
            compiled(torch.randn(65, 3))
        with pytest.raises(SizeError, match=r"batch = 1 .*sizes 0 and 1 are specialized"):
            compiled(torch.randn(1, 3))


def test_dynamic_and_static_captures_never_share_a_cache_entry(tmp_path):
    cache = CaptureCache.open(True, str(tmp_path))
    model, args = MLP().eval(), (torch.randn(4, 3),)
    static = cache.capture_key(model, args, {}, "MLP")
    dynamic = cache.capture_key(model, args, {}, "MLP", {"x": {0: Dim("batch", min=2, max=64)}})
    wider = cache.capture_key(model, args, {}, "MLP", {"x": {0: Dim("batch", min=2, max=128)}})
    assert None not in (static, dynamic, wider) and len({static, dynamic, wider}) == 3


def test_torch_size_expressions_become_kiln_sizes():
    from torch.utils._sympy.functions import CeilDiv, FloorDiv, PythonMod

    s0 = sympy.Symbol("s0", integer=True, positive=True)
    with naming({"s0": "seq"}):
        assert str(kiln_expr(FloorDiv(s0, 2) + 1)) == "floor(seq/2) + 1"
        ceil = SymDim(kiln_expr(CeilDiv(s0, 4)))
        assert [ceil.evaluate({"seq": n}) for n in (2, 4, 5, 9)] == [1, 1, 2, 3]
        assert SymDim(kiln_expr(PythonMod(s0, 3))) == SymDim("Mod(seq, 3)")
    with pytest.raises(ValueError, match="data-dependent"):
        kiln_expr(sympy.Symbol("u0", integer=True))


def test_symbolic_slices_infer_and_canonicalize_leaves_them():
    g = Graph("s")
    seq = SymDim("seq")
    table = g.add_input("pos", TensorType((1, 320), DType.int64))
    x = g.add_input("x", TensorType((2, seq, 8), DType.float32))
    first = g.op("slice", table, dim=1, start=0, end=seq)  # in range: kept as it is
    last = g.op("slice", x, dim=1, start=1, end=2**62)  # to the end
    mid = g.op("slice", x, dim=-2, start=1, end=seq - 1)
    g.set_outputs([first, last, mid])
    assert [str(v.type) for v in g.outputs] == ["i64[1, seq]", "f32[2, seq-1, 8]", "f32[2, seq-2, 8]"]
    assert str(parse(str(g))) == str(g)
    out = PassManager(["canonicalize"]).run(g).graph
    verify(out)
    assert [str(v.type) for v in out.outputs] == [str(v.type) for v in g.outputs]
    sizes = {"seq": 6}
    data = [np.arange(320, dtype=np.int64)[None], np.random.default_rng(0).standard_normal((2, 6, 8), np.float32)]
    got = get_backend("reference").build(specialize(out, sizes), {})([torch.from_numpy(d) for d in data])
    assert got[0].shape == (1, 6) and torch.equal(got[1], torch.from_numpy(data[1])[:, 1:])


def _gpt2(positions: int = 320) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=positions,
                        attn_implementation="sdpa", use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def _bert(positions: int = 320) -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                intermediate_size=64, vocab_size=128, max_position_embeddings=positions,
                                attn_implementation="sdpa")).eval()


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask)[0]


def _tokens(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 128, (2, length))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, length - 3:] = 0
    return ids, mask


@pytest.mark.parametrize("build", [_gpt2, _bert], ids=["gpt2", "bert"])
def test_transformer_exported_with_a_sequence_dim(build):
    model = _Logits(build())
    seq = Dim("seq", min=2, max=300)
    ep = capture_mod.export_program(model, _tokens(16),
                                    dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: seq}})
    captured = capture_mod.capture_program(ep)
    graph = captured.graph
    assert [str(v.type) for v in graph.inputs] == ["i64[2, seq]", "i64[2, seq]"]
    assert (graph.sizes["seq"].lo, graph.sizes["seq"].hi) == (2, 300)
    verify(graph)
    assert str(parse(str(graph))) == str(graph)
    optimized = resolve_passes("default")(graph)  # every default pass on the symbolic graph
    verify(optimized)
    assert not optimized.inputs[0].type.is_static
    ref = get_backend("reference")
    params = [captured.params[v.name] for v in graph.params]
    with torch.no_grad():
        for length in (5, 37, 300):
            ids, mask = _tokens(length)
            want = model(ids, mask)
            for g in (graph, optimized):
                got = ref.build(specialize(g, {"seq": length}), {})([ids, mask, *params])[0]
                assert _rel(got, want) <= 1e-4


def test_bert_under_torch_compile_compiles_one_dynamic_graph():
    model = _bert()
    calls: list[int] = []

    def backend(gm, example_inputs, **kwargs):
        from kiln.frontends.torch.dynamo import kiln_backend

        calls.append(sum(isinstance(x, torch.SymInt) for x in example_inputs))
        return kiln_backend(gm, example_inputs, options={"backend": "reference"})

    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        for length in (5, 9, 77, 300):
            ids, mask = _tokens(length)
            got = compiled(input_ids=ids, attention_mask=mask)[0]
            assert _rel(got, model(input_ids=ids, attention_mask=mask)[0]) <= 1e-4
    assert len(calls) == 2 and calls[0] == 0 and calls[1] > 0  # static first graph, then one dynamic


def test_size_guard_refuses_a_call_outside_the_dynamo_graphs_range():
    from kiln.frontends.torch.fallback import SizeGuard

    g = Graph("d")
    s0 = SymDim("s0")
    g.set_outputs([g.op("relu", g.add_input("x", TensorType((s0, 3), DType.float32)))])
    from kiln.ir.types import SizeRange

    g.sizes = {"s0": SizeRange(2, 320)}
    guard = SizeGuard(g, [1], {0: s0})
    assert guard.check([5, torch.zeros(5, 3)]) == {"s0": 5}
    with pytest.raises(SizeError, match=r"size s0 = 321 is outside its range \[2, 320\]"):
        guard.check([321, torch.zeros(321, 3)])
    with pytest.raises(SizeError, match=r"size argument 0 is 6, but the tensor shapes give s0 = 5"):
        guard.check([6, torch.zeros(5, 3)])
