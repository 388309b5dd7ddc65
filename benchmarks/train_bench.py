"""The training-step benchmark: one whole step (forward, loss, backward, AdamW update) per call.

``python -m benchmarks --train`` (see docs/benchmarks.md, "Training step"; ``--models seeds``:
the seed workloads' steps of :mod:`benchmarks.workloads.training`, docs/workloads.md).  It reuses the
inference harness end to end -- preparation with its memory window, warm-up, interleaved
timing rounds, statistics, ratios, the report -- and differs only in what one call is:

* ``eager``: ``loss = loss_fn(model(*inputs), *targets); loss.backward(); optimizer.step();
  optimizer.zero_grad()``.
* ``inductor``: the same step with the model and the loss compiled together by
  ``torch.compile(dynamic=False)`` (Inductor; the backward graph comes from AOTAutograd, as
  torch builds it); ``optimizer.step()`` and ``zero_grad()`` stay eager.
* ``kiln`` / ``kiln-cpu``: :func:`kiln.compile_train` with kiln's default backend
  (``kiln.backends.DEFAULT_BACKEND``, or ``--kiln-backend``) / with the ``cpu`` backend when
  ``available_backends()`` lists it and differs from ``kiln``'s: forward, kiln's own
  backward and the AdamW update in one graph, every forward value the backward reads kept
  alive until its last use.
* ``kiln-unfused`` / ``kiln-unfused-remat``: ``compile_train(..., passes=None)`` without and
  with ``remat=True``: the step graph as autodiff builds it, unfused, where the ``remat`` pass
  has the most to recompute (fusion keeps forward intermediates inside multi-output kernels).
* ``kiln-remat``: the same as ``kiln`` with ``compile_train(..., remat=True)``: cheap forward
  values are recomputed in the backward (the ``remat`` pass), so the memory plan can reuse
  their buffers.

Every system trains its own deep copy of the model with its own ``AdamW(lr=1e-3)``, so all
start from the same weights; ``max rel err`` compares a system's first-step loss (the loss
before any update) with eager's.  The models run in training mode; GPT-2's dropout
probabilities are 0 so that every system computes the same function (kiln rejects random
dropout in training mode).

Activation memory: for each kiln system without remat the joint graph of the step is rebuilt
from the captured forward (:func:`kiln.passes.autodiff.grad_graph`, the parameters the step
updates as ``wrt``) and cut with :func:`~kiln.passes.autodiff.split_joint` under ``save-all``
and ``remat``; ``saved_bytes`` of both are reported.  The compiled step itself is one graph: each
kiln system's notes give its planned peak (the backend's memory-plan arena, when the backend
plans memory) and, for ``kiln-remat``, how many nodes the ``remat`` pass recomputes.  The
cpu backend allocates that arena once, at the first call, so it counts in ``held MB``
rather than in the per-call ``run peak MB``.  For eager, the bytes of the distinct tensor
storages autograd saves during one forward (``saved_tensors_hooks``; parameters, their views
and the inputs excluded) are reported beside them.
"""

from __future__ import annotations

import copy
import gc
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .harness import (
    SCHEMA,
    BenchConfig,
    _Entry,
    _gc_frozen,
    _isolated_caches,
    _prepare,
    _Progress,
    finish_document,
    time_entries,
)
from .models import MLP, SEED, SEEDS
from .report import (
    SystemResult,
    compute_ratios,
    describe_machine,
    summarize,
)
from .systems import Inputs, Prepared, System, describe_error, first_array

TRAIN_SCHEMA = SCHEMA.replace("bench", "bench-train")
TRAIN_SYSTEM_NAMES = ("eager", "inductor", "kiln", "kiln-remat", "kiln-unfused", "kiln-unfused-remat", "kiln-cpu")
LEARNING_RATE = 1e-3


# --------------------------------------------------------------------------- workloads


class TrainingTask(nn.Module):
    """A model with its loss: ``loss_fn(model(*args[:num_inputs]), *args[num_inputs:])``.

    Systems receive this and train a deep copy of ``model``; calling it computes the loss."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], num_inputs: int):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(*args[: self.num_inputs]), *args[self.num_inputs:])


class Logits(nn.Module):
    """A Hugging Face causal LM returning its logits only."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_small_gpt2() -> nn.Module:
    """GPT-2 with 2 layers, 256 wide, 4 heads, vocabulary 5000, 128 positions, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=5000, n_positions=128, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return Logits(GPT2LMHeadModel(config))


@dataclass(frozen=True)
class TrainWorkload:
    """One model, loss and batch: inputs are the model inputs followed by the targets."""

    name: str
    description: str
    loss: str
    batch: int
    seq: int | None
    build: Callable[[], nn.Module]
    loss_fn: Callable[..., torch.Tensor]
    make_args: Callable[[], tuple[torch.Tensor, ...]]
    num_inputs: int = 1
    default: bool = True

    @property
    def model(self) -> str:
        return self.name

    def task(self) -> TrainingTask:
        """The seeded model (training mode) with its loss."""
        torch.manual_seed(SEED)
        return TrainingTask(self.build().train(), self.loss_fn, self.num_inputs)

    def args(self) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(SEED + 1)
        return self.make_args()


def _regression(batch: int, features: int) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: (torch.randn(batch, features), torch.randn(batch, features))


def _tokens(batch: int, seq: int, vocab: int) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: (torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq)))


TRAIN_WORKLOADS: dict[str, TrainWorkload] = {w.name: w for w in (
    TrainWorkload("mlp", "MLP 1024 -> 4096 -> 1024, GELU", "MSE", 64, None, MLP, F.mse_loss,
                  _regression(64, 1024)),
    TrainWorkload("gpt2", "GPT-2 LM, 2 layers, 256 wide, 4 heads, vocab 5000, no dropout", "cross-entropy",
                  4, 128, build_small_gpt2, token_cross_entropy, _tokens(4, 128, 5000)),
    TrainWorkload("tiny-mlp", "MLP 64 -> 128 -> 64 (smoke tests only)", "MSE", 16, None,
                  lambda: MLP(64, 128), F.mse_loss, _regression(16, 64), default=False),
)}


def select_train_workloads(names: list[str] | None = None) -> list[TrainWorkload]:
    """The named training workloads in table order (default: all but ``tiny-mlp``).
    ``seeds`` names every seed workload's training step (:mod:`benchmarks.workloads.training`),
    ``seed-<name>`` one of them, as in the inference harness."""
    if names and any(name == SEEDS or name.startswith("seed-") for name in names):
        from .workloads.training import register

        seeds = register()
        names = [n for name in names for n in (seeds if name == SEEDS else [name])]
    unknown = sorted(set(names or ()) - set(TRAIN_WORKLOADS))
    if unknown:
        raise ValueError(f"unknown training workload(s) {', '.join(unknown)}; known: "
                         f"{', '.join(TRAIN_WORKLOADS)}, {SEEDS} and the seed-* workloads")
    return [w for w in TRAIN_WORKLOADS.values() if (w.name in names if names else w.default)]


# --------------------------------------------------------------------------- systems


def _as_task(model: nn.Module) -> TrainingTask:
    if not isinstance(model, TrainingTask):
        raise TypeError(f"training systems take a TrainingTask, got {type(model).__name__}")
    return model


class TrainSystem(System):
    """A system whose call is one training step of its own copy of the model.

    ``saved_for_backward`` holds, after :meth:`prepare`, the activation bytes the system keeps
    for the backward (``{"save-all": n, ...}``) when it can tell."""

    saved_for_backward: dict[str, int] | None = None

    def version(self) -> str:
        return torch.__version__

    def warm_start_note(self) -> str:
        return "not measured for training steps"

    def prepare(self, model: nn.Module, inputs: Inputs, workdir: Path, key: str) -> Prepared:
        task = _as_task(model)
        replica = copy.deepcopy(task)
        optimizer = torch.optim.AdamW(replica.model.parameters(), lr=LEARNING_RATE)
        start = time.perf_counter()
        step, notes = self.build_step(replica, optimizer, inputs)
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        loss = step()
        first = time.perf_counter() - start
        return Prepared(step, cold_start_s=build_s + first, first_output=loss, first_call_s=first, notes=notes)

    def build_step(self, task: TrainingTask, optimizer: torch.optim.Optimizer, args: Inputs
                   ) -> tuple[Callable[[], torch.Tensor], list[str]]:
        """A zero-argument training step returning the loss, and notes for the report."""
        raise NotImplementedError


def _torch_step(loss_of: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer,
                args: Inputs) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        loss = loss_of(*args)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def eager_saved_bytes(task: TrainingTask, args: Inputs) -> int:
    """Bytes of the distinct storages autograd saves for the backward in one eager forward,
    parameters, their views and the step's inputs excluded."""
    excluded = {t.untyped_storage().data_ptr() for t in (*task.parameters(), *args)}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = task(*args)
    del loss
    return sum(saved.values())


class EagerTrain(TrainSystem):
    name, label = "eager", "PyTorch eager"

    def build_step(self, task: TrainingTask, optimizer: torch.optim.Optimizer, args: Inputs
                   ) -> tuple[Callable[[], torch.Tensor], list[str]]:
        self.saved_for_backward = {"autograd": eager_saved_bytes(task, args)}
        return _torch_step(task, optimizer, args), []


class InductorTrain(TrainSystem):
    name, label = "inductor", "torch.compile (Inductor)"

    def build_step(self, task: TrainingTask, optimizer: torch.optim.Optimizer, args: Inputs
                   ) -> tuple[Callable[[], torch.Tensor], list[str]]:
        import torch._dynamo

        torch._dynamo.reset()
        compiled = torch.compile(task, backend="inductor", dynamic=False)
        return _torch_step(compiled, optimizer, args), ["model + loss compiled; optimizer eager"]

    def release(self) -> None:
        import torch._dynamo

        torch._dynamo.reset()


class KilnTrain(TrainSystem):
    """:func:`kiln.compile_train` on ``backend``, with rematerialization when ``remat``."""

    def __init__(self, backend: str, name: str, *, remat: bool = False, passes: str | None = "default"):
        self.backend = backend
        self.remat = remat
        self.passes = passes
        extras = ("" if passes == "default" else ", unfused") + (", remat" if remat else "")
        self.name, self.label = name, f"kiln ({backend}{extras})"

    def version(self) -> str:
        import kiln

        return (f"{kiln.__version__}, backend {self.backend}, passes={self.passes!r}"
                f"{', remat=True' if self.remat else ''}")

    def build_step(self, task: TrainingTask, optimizer: torch.optim.Optimizer, args: Inputs
                   ) -> tuple[Callable[[], torch.Tensor], list[str]]:
        import kiln

        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train_step = kiln.compile_train(task.model, task.loss_fn, optimizer, args, backend=self.backend,
                                            remat=self.remat, passes=self.passes)
        compile_s = time.perf_counter() - start
        if not self.remat and self.passes == "default":  # split_joint's figures: report them once
            self.saved_for_backward = planned_saved_bytes(train_step)
        return (lambda: train_step(*args)), [f"compile {compile_s:.2f} s", *step_notes(train_step.stats)]


def step_notes(stats: dict[str, Any]) -> list[str]:
    """Report notes from :attr:`kiln.compiler.train.TrainStep.stats`: graph size, planned
    peak (when the backend plans memory) and recomputed nodes (with ``remat=True``)."""
    notes = [f"{stats['nodes']} nodes"]
    if stats.get("planned_peak_bytes") is not None:
        notes.append(f"planned peak {stats['planned_peak_bytes'] / 2**20:.2f} MiB "
                     f"(all intermediates {stats['planned_total_bytes'] / 2**20:.2f} MiB)")
    if stats.get("remat"):
        notes.append(f"{stats['recomputed_nodes']} nodes recomputed")
    return notes


def planned_saved_bytes(train_step: Any) -> dict[str, int]:
    """``SavedInfo.saved_bytes`` under each autodiff policy, for the joint graph of the step's
    captured forward differentiated with respect to the parameters the step updates."""
    from kiln.passes.autodiff import POLICIES, grad_graph, split_joint

    joint = grad_graph(train_step.forward_graph, wrt=list(train_step.layout.params), loss=0)
    return {policy: split_joint(joint, policy=policy)[2].saved_bytes for policy in POLICIES}


def make_train_systems(names: list[str] | None = None, *, kiln_backend: str | None = None) -> list[TrainSystem]:
    """The named training systems (default: all that apply), in canonical order.

    ``kiln`` and ``kiln-remat`` use ``kiln_backend`` or kiln's default backend; ``kiln-cpu``
    the ``cpu`` backend, only when it is registered and differs from ``kiln``'s."""
    from kiln.backends import DEFAULT_BACKEND, available_backends

    unknown = sorted(set(names or ()) - set(TRAIN_SYSTEM_NAMES))
    if unknown:
        raise ValueError(f"unknown training system(s) {', '.join(unknown)}; known: {', '.join(TRAIN_SYSTEM_NAMES)}")
    default_backend = kiln_backend or DEFAULT_BACKEND
    systems: list[TrainSystem] = []
    for name in TRAIN_SYSTEM_NAMES:
        if names and name not in names:
            continue
        if name == "eager":
            systems.append(EagerTrain())
        elif name == "inductor":
            systems.append(InductorTrain())
        elif name == "kiln":
            systems.append(KilnTrain(default_backend, "kiln"))
        elif name == "kiln-remat":
            systems.append(KilnTrain(default_backend, "kiln-remat", remat=True))
        elif name == "kiln-unfused":
            systems.append(KilnTrain(default_backend, "kiln-unfused", passes=None))
        elif name == "kiln-unfused-remat":
            systems.append(KilnTrain(default_backend, "kiln-unfused-remat", remat=True, passes=None))
        elif "cpu" in available_backends() and default_backend != "cpu":
            systems.append(KilnTrain("cpu", "kiln-cpu"))
    return systems


# --------------------------------------------------------------------------- measuring


def bench_train_workload(workload: TrainWorkload, systems: list[TrainSystem], config: BenchConfig,
                         workdir: Path, progress: _Progress) -> dict[str, Any]:
    """Measure every system's training step on one workload; returns its JSON record."""
    record: dict[str, Any] = {"name": workload.name, "model": workload.name, "description": workload.description,
                              "batch": workload.batch, "seq": workload.seq, "loss": workload.loss,
                              "optimizer": f"AdamW(lr={LEARNING_RATE:g})", "saved_for_backward": {}}
    try:
        task, args = workload.task(), workload.args()
        with torch.no_grad():
            reference = first_array(copy.deepcopy(task)(*args))
    except Exception as error:  # noqa: BLE001 - without eager's loss nothing can be checked
        reason = f"the model fails in eager mode: {describe_error(error)}"
        record["results"] = {s.name: asdict(SystemResult(s.name, status="failed", reason=reason)) for s in systems}
        progress.step(f"{workload.name}: eager failed", advance=len(systems) + config.rounds + 1)
        return record
    entries = [_Entry(system, SystemResult(system.name)) for system in systems]
    for entry in entries:
        progress.show(f"{workload.name}: {entry.system.name} compile")
        entry.system.saved_for_backward = None
        _prepare(entry, task, args, reference, workdir, workload.name)
        if entry.system.saved_for_backward is not None:
            record["saved_for_backward"][entry.system.name] = dict(entry.system.saved_for_backward)
        progress.step(f"{workload.name}: {entry.system.name} ready")
    time_entries(entries, config, progress, workload.name)
    for entry in entries:
        summarize(entry.result, entry.rounds)
        entry.prepared = None
        if entry.result.status == "ok":
            entry.result.warm_note = entry.system.warm_start_note()
        entry.system.release()
    progress.step(f"{workload.name}: done")
    results = {entry.system.name: entry.result for entry in entries}
    compute_ratios(results)
    record["results"] = {name: asdict(result) for name, result in results.items()}
    gc.collect()
    return record


def train_config(config: BenchConfig) -> BenchConfig:
    """``config`` with the training defaults: 10 timed steps per round, 2 warm-up steps,
    60 s budget per system per round (quick: 1 warm-up step, 20 s)."""
    quick = config.quick
    return BenchConfig(
        models=config.models, systems=config.systems, quick=quick, runs=config.runs or 10,
        warmup=config.warmup if config.warmup is not None else (1 if quick else 2), rounds=max(1, config.rounds),
        budget_s=config.budget_s or (20.0 if quick else 60.0), block=config.block, settle_s=config.settle_s,
        out=Path(config.out) / "train" if config.out is not None else None, threads=config.threads,
        kiln_backend=config.kiln_backend, progress=config.progress, plot=config.plot)


def run_train(config: BenchConfig) -> dict[str, Any]:
    """Run the training-step benchmark; writes ``results.md``/``.json``/``.png`` to
    ``config.out / "train"`` (unless ``config.out`` is ``None``) and returns the document."""
    config = train_config(config)
    workloads = select_train_workloads(config.models)
    systems = make_train_systems(config.systems, kiln_backend=config.kiln_backend)
    started = datetime.now(UTC)
    machine = describe_machine()
    machine["torch_threads"] = config.threads or machine["torch_threads"]
    threads_before = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    records: list[dict[str, Any]] = []
    progress = _Progress(len(workloads) * (len(systems) + config.rounds + 1), config.progress)
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-bench-train-") as tmp, _isolated_caches(Path(tmp)), \
                _gc_frozen():
            for workload in workloads:
                records.append(bench_train_workload(workload, systems, config, Path(tmp), progress))
    finally:
        progress.close()
        torch.set_num_threads(threads_before)
    return finish_document(
        TRAIN_SCHEMA, started, config, machine, systems, records,
        title="kiln training-step benchmark results",
        mode_note=(f"float32, one call = one training step (forward, loss, backward, "
                   f"AdamW(lr={LEARNING_RATE:g}) update, zero_grad)."),
        error_note="- `max rel err`: |first-step loss - eager's| / |eager's| (same initial weights).")
