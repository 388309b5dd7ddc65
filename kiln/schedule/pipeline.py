"""Pipeline stages with micro-batches, 1F1B, on torch.distributed point-to-point calls.

``cut_pipeline_stage()`` after blocks of one ModuleList (``transformer.h``) splits the model
into ``cuts + 1`` stages, one per rank: stage ``s`` owns its range of blocks; the first stage
also owns what the model computes before the blocks, the last what it computes after them.
The model's own ``forward`` runs unchanged on every stage: blocks of other stages are
replaced by a pass-through, a later stage's first block takes the activation received from
the previous stage instead of its input, and an earlier stage stops after its last block
and sends the activation on.  (A later stage still computes the cheap prologue -- the
embeddings -- only to discard it; parameters outside the blocks exist on every stage and
their gradients are summed over the stages, which also keeps tied embeddings right.)

:meth:`PipelineModule.train_step` runs one step over a list of micro-batches in 1F1B order:
stage ``s`` of ``S`` runs ``S - s - 1`` forwards, then alternates one forward and one
backward, then drains the backwards.  Sends are asynchronous (``isend``), receives block,
so the order never deadlocks.  Each message is a small shape header then the tensor, so
micro-batches may differ in shape (see :func:`~kiln.schedule.plan_microbatches`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kiln.ir.errors import ScheduleError

from .build import map_first, map_input

_HEADER = 8


class _StageDone(Exception):
    def __init__(self, output: torch.Tensor):
        super().__init__("pipeline stage done")
        self.output = output


class _PassThrough(nn.Module):
    """A block of another stage: returns its hidden-state input."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs["hidden_states"]


def _send(t: torch.Tensor, dst: int, works: list) -> None:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = t.dim()
    header[1:1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    works.append(dist.isend(header, dst))
    data = t.detach().contiguous()
    works.append((dist.isend(data, dst), data))


def _recv(src: int, dtype: torch.dtype) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    dist.recv(header, src)
    shape = tuple(int(v) for v in header[1:1 + int(header[0])])
    out = torch.empty(shape, dtype=dtype)
    dist.recv(out, src)
    return out


class PipelineModule(nn.Module):
    """One rank's stage of a pipelined model (see the module docstring)."""

    def __init__(self, model: nn.Module, cuts: Sequence[str], world: int, rank: int):
        super().__init__()
        stages = len(cuts) + 1
        if stages != world:
            raise ScheduleError(f"pipeline: {len(cuts)} cut(s) make {stages} stages, but there are {world} ranks; "
                                f"cut the blocks into {world} stages (one per rank)")
        blocks_path = cuts[0].rpartition(".")[0]
        blocks = model.get_submodule(blocks_path)
        ends = sorted(int(c.rpartition(".")[2]) + 1 for c in cuts) + [len(blocks)]
        starts = [0] + ends[:-1]
        self.model = model
        self.stage, self.num_stages = rank, stages
        self.blocks_path = blocks_path
        self.owned = range(starts[rank], ends[rank])
        self._input: torch.Tensor | None = None
        for i in range(len(blocks)):
            if i not in self.owned:
                blocks[i] = _PassThrough()
        if rank > 0:
            blocks[self.owned.start].register_forward_pre_hook(self._take_input, with_kwargs=True)
        if rank < stages - 1:
            blocks[self.owned.stop - 1].register_forward_hook(self._stop)
        self._dtype = next(model.parameters()).dtype

    def stage_of(self, name: str) -> str:
        return "blocks" if name.startswith(self.blocks_path + ".") else "shared"

    def _take_input(self, module, args, kwargs):
        return map_input(args, kwargs, lambda t: self._input)

    def _stop(self, module, args, output):
        raise _StageDone(map_first(output, lambda t: t) if isinstance(output, torch.Tensor) else output[0])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def train_step(self, microbatches: Sequence[tuple[tuple, Any]],
                   loss_fn: Callable[[Any, Any], torch.Tensor],
                   optimizer: torch.optim.Optimizer | None = None) -> float:
        """One training step over ``microbatches`` (``(model_args, target)`` pairs): the loss
        is the mean of ``loss_fn(output, target)`` over them.  Gradients accumulate in
        ``.grad`` (summed over stages for parameters outside the blocks); ``optimizer.step()``
        and ``zero_grad()`` run when it is given.  Returns the loss on every rank."""
        s, S, M = self.stage, self.num_stages, len(microbatches)
        if M == 0:
            raise ScheduleError("pipeline.train_step: no micro-batches")
        works: list = []
        saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        total = torch.zeros(())

        def forward(i: int) -> None:
            args, target = microbatches[i]
            received = None
            if s > 0:
                received = _recv(s - 1, self._dtype).requires_grad_(True)
                self._input = received
            try:
                out = self.model(*args)
            except _StageDone as done:
                _send(done.output, s + 1, works)
                saved.append((received, done.output))
                return
            finally:
                self._input = None
            if s < S - 1:
                raise ScheduleError(f"pipeline stage {s}: the forward never reached the end of its blocks")
            loss = loss_fn(out, target) / M
            total.add_(loss.detach())
            saved.append((received, loss))

        def backward() -> None:
            received, out = saved.pop(0)
            if s == S - 1:
                out.backward()
            else:
                out.backward(_recv(s + 1, out.dtype))
            if s > 0:
                grad = received.grad if received.grad is not None else torch.zeros_like(received)
                _send(grad, s - 1, works)

        warmup = min(S - s - 1, M)
        for i in range(warmup):
            forward(i)
        for i in range(warmup, M):
            forward(i)
            backward()
        while saved:
            backward()
        for w in works:
            (w[0] if isinstance(w, tuple) else w).wait()
        self._sum_shared_grads()
        dist.broadcast(total, S - 1)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return float(total)

    def _sum_shared_grads(self) -> None:
        shared = [p for n, p in self.model.named_parameters() if self.stage_of(n) == "shared"]
        if not shared:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in shared])
        dist.all_reduce(flat)
        offset = 0
        for p in shared:
            piece = flat[offset:offset + p.numel()].view_as(p)
            p.grad = piece.clone()
            offset += p.numel()


__all__ = ["PipelineModule"]
