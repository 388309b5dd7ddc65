"""Graph passes: infrastructure, rewriting and optimizations.

Importing this package registers the built-in passes (``dce``, ``cse``, ``fold``,
``simplify``, ``canonicalize``, ``sink-views``, ``composites``, ``fuse``, ``amp``, ``remat``,
``decompose``, ``recompute``, ``inline-custom-vjp``), each from the module named after it:
:func:`~kiln.passes.base.load_passes` imports every module of this folder, so a new pass
module is registered without being named here.  See ``docs/passes.md`` (``amp``,
``remat``: ``docs/training.md``).
"""

from kiln.passes.base import Pass, PassResult, get_pass, load_passes, register_pass, registered_passes
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

load_passes()  # every pass module of this folder registers its passes
from kiln.passes.pipeline import DEFAULT_ORDER, DEFAULT_PIPELINE, default_pipeline  # noqa: E402


def learned_pipeline(*args, **options):
    """The learned pipeline: passes ordered per graph by a trained policy, with the default
    pipeline as fallback (:class:`kiln.passes.ordering.learned.LearnedPipeline`; see
    ``docs/pass-ordering.md``).  Imported on first use."""
    from kiln.passes.ordering.learned import learned_pipeline as make

    return make(*args, **options)


__all__ = [
    "DEFAULT_ORDER", "DEFAULT_PIPELINE", "DUMP_ENV_VAR", "Builder", "Match", "Pass", "PassError", "PassManager",
    "PassResult", "PassStats", "Pat", "PatternPass", "PipelineSyntaxError", "Rewrite",
    "RewriteError", "any_value", "apply_patterns", "const", "default_pipeline", "get_pass",
    "learned_pipeline", "load_passes",
    "op", "parse_pipeline", "pattern_pass", "pipeline_text", "register_pass",
    "registered_passes", "rewrite",
]
