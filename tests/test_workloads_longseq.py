"""LongViT at long sequences (``benchmarks/workloads/longseq.py``).

* compiled by kiln on the cpu backend with kiln's fused attention forced
  (``KILN_NATIVE_KERNELS=1``) at 4096 tokens, it matches eager within 1e-4, the attention
  step runs kiln's kernel, and nothing the memory plan or the kernel allocates comes near
  the ``S x S`` scores: the planned arena and every planned buffer stay under 1/20 of them,
  and a call's measured peak memory too;
* the naive attention the benchmark compares against is SDPA's math;
* on two gloo processes, LongViT with its blocks as a sequence-parallel region (half the
  tokens per rank, attention on the full sequence with half the heads) gives the
  one-process output, eagerly and compiled by kiln per rank with the collectives as graph
  ops.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import kiln
from benchmarks.workloads import longseq
from benchmarks.workloads.vision import SDPA, Block

REL_TOL = 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def test_block_attention_is_a_module_with_sdpa_numerics():
    torch.manual_seed(0)
    block = Block(32, 4).eval()
    assert isinstance(block.attn, SDPA) and not list(block.attn.parameters())
    q, k, v = torch.randn(3, 2, 4, 50, 8).unbind(0)
    torch.testing.assert_close(longseq.naive_attention(q, k, v),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-6)
    assert longseq.image_size(16384) == 1024 and longseq.score_bytes(16384, 4) == 4 * 2 ** 30
    with pytest.raises(ValueError, match="square"):
        longseq.image_size(8192)


def test_compiled_longvit_4k_tokens_fused_attention_without_scores_buffer(monkeypatch, one_torch_thread):
    monkeypatch.setenv("KILN_NATIVE_KERNELS", "1")
    tokens, heads = 4096, 4
    model = longseq.make_model(tokens, heads=heads, depth=1)
    images = longseq.make_images(tokens)
    fast = kiln.compile(model, (images,), backend="cpu", strict=True, cache=False)
    assert longseq.attention_kernels(fast) == ["kiln"]
    with torch.no_grad():
        want = model(images)
        got, peak, _ = longseq.peak_growth(lambda: fast(images))
    assert _rel(got, want) <= REL_TOL, _rel(got, want)
    scores = longseq.score_bytes(tokens, heads)  # 256 MiB
    plan = fast.executable.plan
    assert 0 < plan.arena_bytes < scores / 20, (plan.arena_bytes, scores)
    biggest = max(math.prod(spec.shape) * spec.dtype.itemsize for spec in plan.arena_specs)
    assert biggest < scores / 20, biggest
    assert longseq.kernel_scratch_bytes(tokens, 16) < scores / 200  # O(S * head_dim) per thread
    assert peak < scores / 20, f"first call grew the resident set by {peak / 2 ** 20:.1f} MiB"


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not built in")
def test_sequence_parallel_longvit_two_gloo_ranks_equals_one_process():
    # 1024 tokens, batch 1 (the sequence slice of a contiguous [1, S, D] input must not be a
    # view of it), 2 blocks; each rank compares its output and the gradients of every
    # parameter (summed over the ranks) with the one-process ones itself
    reports = longseq.run_sequence_parallel(1024, batch=1, depth=2, compile_too=True)
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["eager_rel"] <= REL_TOL and r["compiled_rel"] <= REL_TOL and r["grad_rel"] <= REL_TOL, r
        assert r["shapes"]["block_input"] == (1, 512, 64), r  # each rank holds half the tokens
        assert r["shapes"]["compiled_attention_q"] == (1, 2, 1024, 16), r  # full sequence, half the heads
        assert r["collectives"] == {"reduce_scatter": 1, "all_to_all": 8, "all_gather": 1}, r
        assert r["kernels"] == ["kiln", "kiln"], r
