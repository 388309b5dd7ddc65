"""Graph passes: infrastructure, rewriting and optimizations.

Importing this package registers the built-in passes (``dce``, ``cse``, ``fold``,
``simplify``, ``canonicalize``, ``sink-views``, ``composites``, ``fuse``).  See
``docs/passes.md``.
"""

from kiln.passes.base import Pass, PassResult, get_pass, register_pass, registered_passes
from kiln.passes.manager import (
    DUMP_ENV_VAR,
    PassError,
    PassManager,
    PassStats,
    PipelineSyntaxError,
    parse_pipeline,
    pipeline_text,
)
from kiln.passes.pattern import (
    Builder,
    Match,
    Pat,
    PatternPass,
    Rewrite,
    RewriteError,
    any_value,
    apply_patterns,
    const,
    op,
    pattern_pass,
    rewrite,
)

# Built-in passes register themselves on import.
from kiln.passes import canonicalize, composites, cse, dce, fold, fusion, layout, simplify  # noqa: E402,F401  isort: skip
from kiln.passes.pipeline import DEFAULT_PIPELINE, default_pipeline  # noqa: E402

__all__ = [
    "DEFAULT_PIPELINE", "DUMP_ENV_VAR", "Builder", "Match", "Pass", "PassError", "PassManager",
    "PassResult", "PassStats", "Pat", "PatternPass", "PipelineSyntaxError", "Rewrite",
    "RewriteError", "any_value", "apply_patterns", "const", "default_pipeline", "get_pass",
    "op", "parse_pipeline", "pattern_pass", "pipeline_text", "register_pass",
    "registered_passes", "rewrite",
]
