"""Runs the python code blocks of docs/passes.md, so the documentation cannot rot.

Every ```python block before the section "Composite recognition and fusion" runs, in
order, in one namespace (later blocks use names earlier ones define).
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "passes.md"
STOP_HEADING = "## Composite recognition and fusion"
BLOCK_RE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[tuple[int, str]]:
    text = DOC.read_text()
    end = text.find(STOP_HEADING)
    text = text if end < 0 else text[:end]
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in BLOCK_RE.finditer(text)]


def test_docs_have_the_tutorial_blocks():
    sources = [code for _, code in _blocks()]
    assert len(sources) >= 8
    assert any('pattern_pass("abs-of-neg"' in code for code in sources)


def test_doc_code_blocks_run(capsys, monkeypatch):
    module = types.ModuleType("docs_passes")  # dataclasses look their module up in sys.modules
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    for line, code in _blocks():
        try:
            exec(compile(code, f"{DOC}:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"docs/passes.md block at line {line} failed: {e!r}") from e
    assert namespace["AbsOfNeg"].name == "abs-of-neg"
    assert "op changes" in capsys.readouterr().out
