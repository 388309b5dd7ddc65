"""The worked example of docs/ops.md ("Adding an op takes one declaration") runs as written.

The block declares ``mish`` with all its rules and checks, against PyTorch, its outputs and
gradient on the cpu backend, its reference, its decomposition, its cost and its AMP policy.
It runs in a fresh process, so the example op never enters this process's registry.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kiln.ir import has_op

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- new-op example (tests/test_new_op_example.py runs this block) -->"


def example_block() -> str:
    text = (ROOT / "docs" / "ops.md").read_text()
    start = text.index(MARKER)
    match = re.compile(r"```python\n(.*?)^```", re.DOTALL | re.MULTILINE).search(text, start)
    assert match is not None and text[start + len(MARKER):match.start()].strip() == "", \
        "the marker must stand right above the example's python block"
    return match.group(1)


def test_the_example_declares_every_rule():
    code = example_block()
    for rule in ("infer=", "vjp=", "amp=", "decompose=", "cost=", "@defcompute(\"mish\")"):
        assert rule in code, rule
    assert not has_op("mish"), "the example op must not be part of kiln's registry"


def test_the_example_runs_and_prints_the_generated_c():
    done = subprocess.run([sys.executable, "-c", example_block()], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert "%0: f32[4, 64] = mish(%x)" in out
    # the compute definition's expression, as the cpu backend printed it
    statement = next(line for line in out.splitlines() if "tanhf(" in line)
    expression = r"\* tanhf\(logf\(1\.0f \+ kiln_expf\(-fabsf\(b\d+\[v0\]\[v1\]\)\)\) \+ "
    assert re.search(expression, statement), statement
    shown = (ROOT / "docs" / "ops.md").read_text()
    assert statement in shown, "docs/ops.md shows the statement the example prints"
