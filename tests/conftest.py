"""Fixtures shared by several test files (requested by name; only ``fresh_dynamo_per_file``
applies by itself)."""

from __future__ import annotations

import pytest
import torch

from kiln.backends.base import ReferenceExecutable
from kiln.backends.cpu.backend import CpuExecutable


@pytest.fixture(autouse=True, scope="module")
def fresh_dynamo_per_file():
    """Each test file starts with Dynamo's caches empty: otherwise its automatic dynamic shapes
    carry over from another file's compiles of the same code, and graphs arrive symbolic."""
    import sys

    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    yield


@pytest.fixture
def one_torch_thread():
    """The eager reference runs tiny ops, where torch's intra-op threads only add start-up and
    spinning cost (10x slower on a busy 2-core machine): use one thread, then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def builds(monkeypatch):
    """How many graphs the reference and the compiled backends built (``count``), and the
    graphs (``graphs``): a build per size would show as a count above one."""
    from kiln.backends.base import ReferenceBackend
    from kiln.backends.common.build import CompiledBackend

    record = {"count": 0, "graphs": []}
    for cls in (ReferenceBackend, CompiledBackend):
        def counting(self, graph, options=None, original=cls.build):
            record["count"] += 1
            record["graphs"].append(graph)
            return original(self, graph, options)

        monkeypatch.setattr(cls, "build", counting)
    return record


@pytest.fixture
def kiln_runs(monkeypatch):
    """Names of the kiln graphs whose reference or cpu executable ran (proves kiln, not eager,
    ran; ``...forward``/``...backward`` in training)."""
    calls: list[str] = []
    for executable in (ReferenceExecutable, CpuExecutable):
        def counting(self, args, original=executable.__call__):
            calls.append(self.graph.name)
            return original(self, args)

        monkeypatch.setattr(executable, "__call__", counting)
    return calls
