"""Data parallelism: gradients summed (or averaged) over the ranks, in buckets.

:class:`GradientBuckets` groups parameters, in reverse registration order (roughly the order
the backward produces their gradients), into buckets of about ``bucket_bytes``.  When the
last gradient of a bucket has been accumulated (``register_post_accumulate_grad_hook``), the
bucket's gradients are flattened into one buffer and an asynchronous
``torch.distributed.all_reduce`` starts on it, so communication overlaps the rest of the
backward; at the end of the backward (a callback queued on autograd's engine) every
reduction is waited for and the results are copied back into ``.grad``.  A parameter that
took no part in this backward counts as a zero gradient, so every rank reduces the same
buckets.

:func:`data_parallel` wraps a model: its parameters are broadcast from rank 0 once, and its
gradients averaged over the ranks after every backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from kiln.ir.errors import ScheduleError


class GradientBuckets:
    """Bucketed gradient all-reduce over ``params`` (see the module docstring)."""

    def __init__(self, params: Sequence[nn.Parameter], world_size: int, *, average: bool = True,
                 bucket_bytes: int = 4 << 20):
        self.world_size = world_size
        self.average = average
        self.buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        seen: set[int] = set()
        for p in reversed(list(params)):
            if id(p) in seen:
                continue
            seen.add(id(p))
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._ready: list[int] = [0] * len(self.buckets)
        self._pending: dict[int, tuple[torch.Tensor, object]] = {}
        self._queued = False
        self.enabled = True
        self.reductions = 0
        """Buckets reduced so far (a statistic for tests and benchmarks)."""
        for b in self.buckets:
            for p in b:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.enabled or not (dist.is_available() and dist.is_initialized()):
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        i = self._bucket_of[id(p)]
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i]):
            self._launch(i)

    def _launch(self, i: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._pending[i] = (flat, dist.all_reduce(flat, async_op=True))

    def finish(self) -> None:
        """Wait for every bucket (launching those whose parameters got no gradient) and
        write the reduced gradients back; called at the end of each backward."""
        for i in range(len(self.buckets)):
            if i not in self._pending:
                self._launch(i)
        for i, (flat, work) in sorted(self._pending.items()):
            work.wait()
            if self.average:
                flat /= self.world_size
            offset = 0
            for p in self.buckets[i]:
                n = p.numel()
                piece = flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = piece.clone()
                else:
                    p.grad.copy_(piece)
                offset += n
            self.reductions += 1
        self._pending.clear()
        self._ready = [0] * len(self.buckets)
        self._queued = False


def data_parallel(model: nn.Module, *, bucket_bytes: int = 4 << 20) -> nn.Module:
    """``model`` with its parameters broadcast from rank 0 and its gradients averaged over the
    ranks after every backward (``model.kiln_gradient_buckets`` holds the buckets)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ScheduleError("data_parallel: torch.distributed is not initialized; call "
                            "torch.distributed.init_process_group first (gloo on CPUs, nccl on GPUs)")
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    params = [p for p in model.parameters() if p.requires_grad]
    model.kiln_gradient_buckets = GradientBuckets(params, dist.get_world_size(), bucket_bytes=bucket_bytes)
    return model


__all__ = ["GradientBuckets", "data_parallel"]
