"""Dynamic shapes end to end: one compile serves every size in range.

* ``kiln.compile(..., dynamic_shapes=)`` with a ``torch.export.Dim``: built once, correct at
  several sizes, and a size outside the range refused with the range in the message.
* ``torch.compile(model, backend="kiln")`` over eight sequence lengths: kiln's backend is
  invoked at most twice (Dynamo's static first graph and one dynamic graph), nothing runs
  in eager (``strict``), and every output matches eager; the same with ``dynamic=True``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from kiln.ir.sizes import SizeError
from tests.models import MLP

LENGTHS = (5, 17, 33, 64, 100, 128, 257, 300)


def _close(out, ref, rtol=1e-4):
    out = out[0] if isinstance(out, (tuple, list)) else out
    err = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
    assert err <= rtol, f"max relative error {err:.2e} > {rtol}"


def test_mlp_with_a_batch_range_compiles_once_and_refuses_batch_65(builds):
    torch.manual_seed(0)
    model = MLP().eval()
    batch = torch.export.Dim("batch", min=2, max=64)
    fast = kiln.compile(model, (torch.randn(8, 64),), dynamic_shapes=({0: batch},), cache=False, strict=True)
    assert builds["count"] == 1
    graph = builds["graphs"][0]
    assert not graph.inputs[0].type.is_static
    assert str(graph.sizes["batch"]) == "[2, 64]"
    with torch.no_grad():
        for n in (2, 7, 64):
            x = torch.randn(n, 64)
            _close(fast(x), model(x))
    assert builds["count"] == 1, "a new batch size rebuilt the graph"
    with pytest.raises(SizeError, match=r"batch = 65 is outside its range \[2, 64\]"):
        fast(torch.randn(65, 64))
    with pytest.raises(kiln.KilnError, match=r"expects f32\[batch, 64\] but got .*\(4, 63\)"):
        fast(torch.randn(4, 63))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=512, vocab_size=128, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return _Hidden(GPT2Model(config)).eval()


def _bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=512, vocab_size=128, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return _Hidden(BertModel(config, add_pooling_layer=False)).eval()


class _Hidden(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).last_hidden_state


@pytest.mark.parametrize("build, dynamic", [
    pytest.param(_gpt2, None, id="gpt2-dynamic-none"),
    pytest.param(_gpt2, True, id="gpt2-dynamic-true", marks=pytest.mark.slow),
    pytest.param(_bert, None, id="bert-dynamic-none", marks=pytest.mark.slow),
    pytest.param(_bert, True, id="bert-dynamic-true"),
])  # CI runs one of each model and each dynamic setting (each takes 15-25 s); -m slow the others
def test_torch_compile_over_eight_lengths_invokes_kiln_at_most_twice(build, dynamic):
    import torch._dynamo

    from kiln.frontends.torch.dynamo import kiln_backend

    torch._dynamo.reset()
    calls = []

    def counting_backend(gm, example_inputs):
        calls.append(gm)
        return kiln_backend(gm, example_inputs, options={"strict": True, "cache": False})

    model = build()
    compiled = torch.compile(model, backend=counting_backend, dynamic=dynamic)
    with torch.no_grad():
        for n in LENGTHS:
            ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
            _close(compiled(ids), model(ids))
    assert 1 <= len(calls) <= 2, f"kiln's backend was invoked {len(calls)} times for {len(LENGTHS)} lengths"
    torch._dynamo.reset()


class _Scaled(nn.Module):
    """A float attribute read in Python: ``dynamic=True`` lifts it to a 0-d tensor input."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.scale = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, (16,), self.norm.weight, self.norm.bias, eps=1e-5) * self.scale


def test_lifted_python_scalars_are_specialized_and_guarded_by_value():
    import torch._dynamo

    from kiln.frontends.torch.dynamo import ScalarSpecialized, kiln_backend

    torch._dynamo.reset()
    compiled_graphs = []

    def backend(gm, example_inputs):
        compiled = kiln_backend(gm, example_inputs, options={"strict": True, "cache": False})
        compiled_graphs.append(compiled)
        return compiled

    torch.manual_seed(0)
    model = _Scaled().eval()
    fast = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for n in (3, 9):
            x = torch.randn(n, 16)
            _close(fast(x), model(x))
        model.scale = 2.0  # a new value of the lifted input: kiln's guard builds for it
        x = torch.randn(5, 16)
        _close(fast(x), model(x))
    assert len(compiled_graphs) == 1
    guard = compiled_graphs[0]
    assert isinstance(guard, ScalarSpecialized), "the float attribute was not lifted; the test checks nothing"
    assert len(guard.builds) == 2
    torch._dynamo.reset()
