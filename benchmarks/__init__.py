"""kiln's benchmark harness: kiln beside PyTorch eager, Inductor, ONNX Runtime and TVM.

Run it with ``python -m benchmarks`` or ``kiln bench`` (see ``docs/benchmarks.md``)::

    python -m benchmarks --quick                       # a small subset, under two minutes
    python -m benchmarks --models gpt2 --systems eager,kiln

From Python::

    from benchmarks import BenchConfig, run
    document = run(BenchConfig(models=["mlp"], systems=["eager", "kiln"], quick=True))
"""

from .harness import BenchConfig, SystemResult, run
from .models import MODELS, Workload, select_workloads
from .report import to_markdown, write_outputs
from .systems import SYSTEM_NAMES, System, make_systems

__all__ = [
    "MODELS", "SYSTEM_NAMES", "BenchConfig", "System", "SystemResult", "Workload", "make_systems", "run",
    "select_workloads", "to_markdown", "write_outputs",
]
