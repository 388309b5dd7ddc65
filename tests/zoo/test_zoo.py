"""The model zoo (kiln.zoo): a fast subset of architectures through kiln against eager, the
sweep's machinery, and (marked slow) every entry with every check."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from kiln.compiler import cli
from kiln.zoo import compare as cmp
from kiln.zoo.__main__ import TABLE_BEGIN, TABLE_END, write_markdown
from kiln.zoo.__main__ import main as zoo_main
from kiln.zoo.models import FAST, ZOO, select
from kiln.zoo.registry import ZooEntry
from kiln.zoo.run import CHECKS, markdown_table, run_entry, summary

# Entries that fail today because of a kiln bug or a missing op: xfail(strict=True) until the
# fix lands (then the strict xfail fails and the entry must come off this list).
# name -> (checks that fail, reason)
KNOWN_FAILURES: dict[str, tuple[tuple[str, ...], str]] = {}


def _param(name: str, checks: tuple[str, ...]) -> object:
    known = KNOWN_FAILURES.get(name)
    if known and set(known[0]) & set(checks):
        return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=known[1]))
    return name


FAST_CHECKS = ("inference", "grad")


@pytest.mark.parametrize("name", [_param(n, FAST_CHECKS) for n in FAST])
def test_fast_subset_inference_and_gradients(name, one_torch_thread):
    result = run_entry(ZOO[name], FAST_CHECKS)
    assert set(result.checks) == set(FAST_CHECKS), result.checks
    assert result.status == "pass", result.first_error
    assert result.checks["inference"].compared >= 1
    assert result.checks["grad"].compared >= 2  # the loss and at least one parameter


ALL_CHECKS = tuple(c for c in CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize("name", [_param(n, ALL_CHECKS) for n in ZOO])
def test_every_entry_every_check(name, one_torch_thread):
    result = run_entry(ZOO[name], ALL_CHECKS)
    assert result.status == "pass", result.first_error


# ------------------------------------------------------------------ the registry


def test_registry_covers_the_families():
    hf = {e.family for e in ZOO.values() if e.build.__module__.endswith(("hf_text", "hf_vision"))}
    assert len(hf) >= 30, sorted(hf)
    kinds = {e.kind for e in ZOO.values()}
    assert {"decoder", "encoder", "encoder-decoder", "vision", "conv", "speech", "segmentation",
            "two-tower", "nn"} <= kinds
    assert set(FAST) <= set(ZOO)
    assert set(KNOWN_FAILURES) <= set(ZOO)
    with pytest.raises(KeyError, match="no zoo entry 'nope'"):
        select(["nope"])


def test_a_small_entry_builds_seeded():
    (m1, x1), (m2, x2) = ZOO["pointnet_knn"].build(), ZOO["pointnet_knn"].build()
    assert all(torch.equal(a, b) for a, b in zip(x1, x2))
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))


# ------------------------------------------------------------------ the sweep's machinery


class _WrongWhenCompiled(nn.Module):
    """1% off when traced by a compiler (kiln.compile and torch.compile), right in eager:
    the sweep must report a wrong answer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * 1.01 if torch.compiler.is_compiling() else y


class _Fft(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.fft.rfft(x).abs())


def _entry(name: str, build) -> ZooEntry:
    return ZooEntry(name, name, "nn", build)


def _seeded(cls):
    def build():
        torch.manual_seed(0)
        return cls(), (torch.randn(2, 4 if cls is _WrongWhenCompiled else 8, generator=torch.Generator().manual_seed(1)),)
    return build


def test_a_wrong_answer_fails_inference_and_gradients(one_torch_thread):
    result = run_entry(_entry("wrong", _seeded(_WrongWhenCompiled)), ("inference", "grad", "fallback"))
    assert result.checks["inference"].status == "fail"
    assert result.checks["inference"].error == pytest.approx(0.01, rel=1e-3)
    assert result.checks["grad"].status == "fail"
    assert result.status == "fail"
    assert "differ from eager" in result.first_error


def test_an_unsupported_op_is_an_error_and_a_fallback(one_torch_thread):
    result = run_entry(_entry("fft", _seeded(_Fft)), ("inference", "fallback"))
    inference = result.checks["inference"]
    assert inference.status == "error"
    assert inference.message.startswith("UnsupportedOpError: kiln cannot lower ATen op aten._fft_r2c")
    assert result.checks["fallback"].status == "pass"  # the fallback runs it in PyTorch, correctly
    assert result.fallback_ops.get("aten._fft_r2c.default") == 1  # (and the complex abs after it)
    assert result.checks["fallback"].extra["warnings"] == 1
    table = markdown_table([result])
    assert "| fft | fft | nn |" in table and "`aten._fft_r2c.default`×1" in table
    assert "aten._fft_r2c.default (fft)" in summary([result])


def test_a_model_that_does_not_build_is_recorded():
    def broken():
        raise RuntimeError("no such layer\nsecond line")

    result = run_entry(_entry("broken", broken))
    assert result.status == "error"
    assert result.first_error == "build: RuntimeError: no such layer"


def test_comparison_by_float32_noise_is_reported():
    exact = torch.zeros(4, dtype=torch.float64)
    eager = torch.full((4,), 1e-7)
    kiln = torch.full((4,), -3e-7)
    c = cmp.compare("bias.grad", kiln, eager, exact)
    assert c.ok and c.by_float32_noise
    assert not cmp.compare("bias.grad", torch.full((4,), 1e-5), eager, exact).ok


# ------------------------------------------------------------------ command line


def test_cli_lists_and_rejects(capsys):
    assert cli.main(["zoo", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "swin" in listed and "pointnet_knn" in listed
    assert zoo_main(["--models", "nope"]) == 2
    assert "no zoo entry nope" in capsys.readouterr().err
    assert zoo_main(["--checks", "inference,nope"]) == 2


def test_cli_runs_writes_markdown_and_json(tmp_path, capsys, one_torch_thread):
    doc = tmp_path / "zoo.md"
    doc.write_text(f"# intro\n{TABLE_BEGIN}\nold\n{TABLE_END}\ntail\n")
    out = tmp_path / "out.json"
    status = zoo_main(["--models", "pointnet_knn", "--checks", "capture", "--markdown", str(doc),
                       "--json", str(out)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data[0]["name"] == "pointnet_knn" and set(data[0]["checks"]) == {"capture"}
    assert status == (0 if data[0]["status"] == "pass" else 1)
    text = doc.read_text()
    assert text.startswith("# intro\n") and text.endswith("tail\n") and "old" not in text
    assert "| pointnet_knn | pointnet | nn |" in text and "kiln zoo: 1 models" in printed


def test_write_markdown_without_markers(tmp_path):
    path = tmp_path / "t.md"
    write_markdown(path, "| a |")
    assert path.read_text() == f"{TABLE_BEGIN}\n| a |\n{TABLE_END}\n"
