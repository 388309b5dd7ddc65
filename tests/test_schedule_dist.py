"""kiln.schedule on 2 CPU processes with gloo: tensor, sequence, data and pipeline parallelism,
verify, and a sharded training step compiled by kiln as one graph.

Each test spawns one process group that runs several checks of :mod:`dist_workers` (process
start-up with torch imported costs seconds, so the fast test shares one group); the group has
a 60 s timeout, so a hung collective fails the test instead of hanging.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import dist_workers

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not built in")


def test_two_ranks_tensor_sequence_pipeline_data_parallel_and_compiled_step():
    # GPT-2 and ViT: tensor parallel and sequence parallel outputs and gathered gradients equal
    # one process within 1e-5; verify names the parameter of a row-parallel bias added per rank;
    # a 2-stage 1F1B pipeline over planned micro-batches gives one process's losses for 3
    # steps; bucketed data-parallel gradients; a tensor-parallel step compiled as one graph.
    # (the compiled step runs on the reference backend here: the cpu backend's C build costs
    # more; the slow test runs it on the cpu backend, where the collectives are library calls)
    dist_workers.spawn(["tensor_parallel", "sequence_parallel", "wrong_bias", "pipeline", "data_parallel",
                        "compiled_mlp_reference"])


@pytest.mark.slow
def test_two_ranks_eager_attention_cpu_backend_and_compiled_gpt2():
    dist_workers.spawn(["eager_attention", "compiled_mlp", "compiled_collectives"])
