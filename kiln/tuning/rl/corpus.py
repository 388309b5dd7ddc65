"""The corpus of graphs pass ordering trains and evaluates on, cached on disk as IR text.

Families (each a list of named, seeded builders; :data:`FAMILIES`):

===============  ======  ======================================================================
family           split   graphs
===============  ======  ======================================================================
``gpt2``         train   GPT-2 LM heads from small configs (1-3 layers, width 64-128, sequence
                         8-32), with PyTorch's ``sdpa`` and its ``eager`` attention
``bert``         train   BERT encoders from small configs, ``sdpa`` and ``eager`` attention
``cnn``          train   ResNet-18 (32x32 and 64x64 inputs) and a small CNN zoo model
``mlp``          train   MLPs with ReLU, tanh-GELU and SiLU-gated layers
``decomposed``   train   GPT-2 and BERT graphs with their composite ops expanded by
                         ``decompose`` (what a capture without kiln's composite ops gives)
``training``     train   training graphs (forward + backward, from ``kiln.passes.autodiff``)
                         of an MLP and a small GPT-2, when the autodiff pass is available
``random``       train   random graphs built to give every pass work (:func:`random_graph`)
``opt``          heldout OPT decoders (never seen in training)
``distilbert``   heldout DistilBERT encoders
``convnext``     heldout a ConvNeXt-like net: depthwise 7x7 convs, channels-last layer
                         norm, inverted-bottleneck MLP with GELU, layer scale
===============  ======  ======================================================================

The held-out split is whole families: an agent never sees an OPT, DistilBERT or ConvNeXt
graph during training.  ``size="small"`` keeps the first builder of each family (tests).

Captured graphs are written to ``<cache_dir>/corpus/<fingerprint>/<name>.kir`` and read
back with :func:`kiln.ir.parse`; the fingerprint hashes the torch and transformers versions,
kiln's capture sources and the corpus builders (for training graphs also the autodiff pass
and the op rules), so a change to any of them rebuilds the cache.  ``cache_dir`` defaults
to ``$KILN_CACHE_DIR`` or ``~/.cache/kiln``.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.ir import DType, Graph, KilnError, TensorType, Value, parse

SPLITS = ("train", "heldout")
HELDOUT_FAMILIES = ("opt", "distilbert", "convnext")
CORPUS_VERSION = "1"


@dataclass(frozen=True)
class CorpusEntry:
    """One graph of the corpus: a unique ``name``, its ``family`` and ``split``."""

    name: str
    family: str
    split: str
    graph: Graph


Builder = Callable[[], Graph]


# ------------------------------------------------------------------------ random graphs
_UNARY = ("relu", "tanh", "sigmoid", "exp", "neg", "abs")
_BINARY = ("add", "mul", "sub", "maximum")


def random_graph(seed: int, size: int = 24, batch: int = 4, width: int = 8) -> Graph:
    """A random ``f32`` graph whose pieces give every pass something to do.

    It mixes plain elementwise ops and matmuls with: identities (``x * 1``, ``x + 0``;
    simplify), constant subexpressions (fold), repeated subexpressions (cse), dead nodes
    (dce), ``sub`` of constants (canonicalize), permute and reshape round trips
    (simplify, sink-views) and decomposed softmax, GELU, SiLU and layer norm (composites).
    All values are ``f32[batch, width]``; the same seed gives the same graph.
    """
    rng = np.random.default_rng(seed)
    g = Graph(f"random_{seed}")
    t = TensorType((batch, width), DType.float32)
    pool: list[Value] = [g.add_input("x", t), g.add_input("y", t)]
    weights = [g.add_param(f"w{i}", TensorType((width, width), DType.float32)) for i in range(2)]

    def pick() -> Value:
        return pool[int(rng.integers(max(0, len(pool) - 6), len(pool)))]

    def const(value: float) -> Value:
        return g.add_constant(np.array(value, dtype=np.float32))

    def piece(kind: int) -> Value:
        x = pick()
        if kind == 0:
            return g.op(str(rng.choice(_UNARY)), x)
        if kind == 1:
            return g.op(str(rng.choice(_BINARY)), x, pick())
        if kind == 2:
            return g.op("matmul", x, weights[int(rng.integers(len(weights)))])
        if kind == 3:
            return g.op("mul", x, const(1.0)) if rng.random() < 0.5 else g.op("add", x, const(0.0))
        if kind == 4:
            folded = g.op("mul", g.op("add", const(float(rng.integers(1, 4))), const(0.5)), const(2.0))
            return g.op("mul", x, folded)
        if kind == 5:
            return g.op("add", g.op("tanh", x), g.op("tanh", x))
        if kind == 6:
            g.op("exp", x)  # dead
            return g.op("sub", x, const(float(rng.integers(1, 4))))
        if kind == 7:
            flipped = g.op("permute", g.op("permute", x, dims=(1, 0)), dims=(1, 0))
            return g.op("relu", flipped)
        if kind == 8:
            flat = g.op(
                "reshape", g.op("exp", g.op("reshape", x, shape=(batch * width,))), shape=(batch, width)
            )
            return flat
        if kind == 9:
            e = g.op("exp", g.op("sub", x, g.op("amax", x, dims=(1,), keepdim=True)))
            return g.op("div", e, g.op("sum", e, dims=(1,), keepdim=True))
        if kind == 10:
            inner = g.op("erf", g.op("mul", x, const(float(1 / np.sqrt(2)))))
            return g.op("mul", g.op("mul", x, const(0.5)), g.op("add", inner, const(1.0)))
        if kind == 11:
            return g.op("mul", x, g.op("sigmoid", x))
        d = g.op("sub", x, g.op("mean", x, dims=(1,), keepdim=True))
        var = g.op("mean", g.op("mul", d, d), dims=(1,), keepdim=True)
        return g.op("mul", d, g.op("rsqrt", g.op("add", var, const(1e-5))))

    while len(g.nodes) < size:
        pool.append(piece(int(rng.integers(13))))
    used = {v for node in g.nodes for v in node.inputs}
    # every unused piece is an output, so only the deliberately dead nodes are dead
    g.set_outputs([v for v in pool[2:] if v not in used] or pool[-1:])
    return g


# ------------------------------------------------------------------------ model builders
def _capture(model, args, kwargs=None) -> Graph:
    from kiln.frontends.torch.capture import capture

    return capture(model, tuple(args), dict(kwargs or {})).graph


def _ids(batch: int, seq: int, vocab: int = 1000):
    import torch

    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def gpt2(layers: int, width: int, seq: int, attention: str = "sdpa") -> Builder:
    def build() -> Graph:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(
            n_layer=layers,
            n_embd=width,
            n_head=4,
            vocab_size=1000,
            n_positions=64,
            use_cache=False,
            attn_implementation=attention,
        )
        return _capture(GPT2LMHeadModel(config).eval(), (_ids(1, seq),))

    return build


def bert(layers: int, width: int, seq: int, attention: str = "sdpa") -> Builder:
    def build() -> Graph:
        import torch
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        config = BertConfig(
            num_hidden_layers=layers,
            hidden_size=width,
            num_attention_heads=4,
            intermediate_size=4 * width,
            vocab_size=1000,
            max_position_embeddings=64,
            attn_implementation=attention,
        )
        mask = torch.ones(1, seq, dtype=torch.int64)
        mask[0, seq - seq // 4 :] = 0
        return _capture(BertModel(config).eval(), (_ids(1, seq),), {"attention_mask": mask})

    return build


def opt(layers: int, width: int, seq: int) -> Builder:
    def build() -> Graph:
        import torch
        from transformers import OPTConfig, OPTForCausalLM

        torch.manual_seed(0)
        config = OPTConfig(
            num_hidden_layers=layers,
            hidden_size=width,
            ffn_dim=4 * width,
            num_attention_heads=4,
            vocab_size=1000,
            max_position_embeddings=64,
            word_embed_proj_dim=width,
            use_cache=False,
        )
        return _capture(OPTForCausalLM(config).eval(), (_ids(1, seq),))

    return build


def distilbert(layers: int, width: int, seq: int) -> Builder:
    def build() -> Graph:
        import torch
        from transformers import DistilBertConfig, DistilBertModel

        torch.manual_seed(0)
        config = DistilBertConfig(
            n_layers=layers,
            dim=width,
            hidden_dim=4 * width,
            n_heads=4,
            vocab_size=1000,
            max_position_embeddings=64,
        )
        return _capture(DistilBertModel(config).eval(), (_ids(1, seq),))

    return build


def convnext(widths: Sequence[int], depths: Sequence[int], image: int) -> Builder:
    def build() -> Graph:
        import torch

        from kiln.tuning.rl.zoo import ConvNeXtLike

        torch.manual_seed(0)
        model = ConvNeXtLike(tuple(widths), tuple(depths)).eval()
        return _capture(model, (torch.randn(1, 3, image, image, generator=torch.Generator().manual_seed(1)),))

    return build


def resnet18(image: int) -> Builder:
    def build() -> Graph:
        import torch

        from kiln.tuning.rl.zoo import resnet18 as make

        return _capture(
            make(), (torch.randn(1, 3, image, image, generator=torch.Generator().manual_seed(1)),)
        )

    return build


def small_cnn() -> Graph:
    import torch

    from kiln.tuning.rl.zoo import SmallCNN

    torch.manual_seed(0)
    return _capture(
        SmallCNN().eval(), (torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)),)
    )


def mlp(width: int, activation: str, depth: int = 3) -> Builder:
    def build() -> Graph:
        import torch

        from kiln.tuning.rl.zoo import MLP

        torch.manual_seed(0)
        return _capture(
            MLP(width, activation, depth).eval(),
            (torch.randn(4, width, generator=torch.Generator().manual_seed(1)),),
        )

    return build


def decomposed(builder: Builder) -> Builder:
    def build() -> Graph:
        from kiln.passes.decompose import Decompose

        return Decompose().run(builder()).graph

    return build


def training(model_builder: Callable[[], tuple]) -> Builder:
    """A forward + backward graph: the joint graph of ``kiln.passes.autodiff.grad_graph``."""

    def build() -> Graph:
        from kiln.passes.autodiff import grad_graph  # optional: ImportError skips the family

        model, args = model_builder()
        return grad_graph(_capture(model, args)).graph

    return build


def _mlp_loss():
    import torch

    from kiln.tuning.rl.zoo import MLP, ScalarLoss

    torch.manual_seed(0)
    return ScalarLoss(MLP(32, "gelu", 3)).eval(), (
        torch.randn(4, 32, generator=torch.Generator().manual_seed(1)),
    )


def _gpt2_loss():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from kiln.tuning.rl.zoo import ScalarLoss

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=1000, n_positions=64, use_cache=False)
    return ScalarLoss(GPT2LMHeadModel(config).eval()).eval(), (_ids(1, 8),)


def _loss_of(model_builder: Callable[[], tuple]) -> Callable[[], tuple]:
    def build():
        from kiln.tuning.rl.zoo import ScalarLoss

        model, args = model_builder()
        return ScalarLoss(model).eval(), args

    return build


def _hf(config_name: str, model_name: str, seq: int, **config) -> Callable[[], tuple]:
    def build():
        import torch
        import transformers

        torch.manual_seed(0)
        cfg = getattr(transformers, config_name)(**config)
        return getattr(transformers, model_name)(cfg).eval(), (_ids(1, seq),)

    return build


def _cnn_loss():
    import torch

    from kiln.tuning.rl.zoo import ScalarLoss, SmallCNN

    torch.manual_seed(0)
    return ScalarLoss(SmallCNN().eval()).eval(), (
        torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
    )


def _convnext_loss():
    import torch

    from kiln.tuning.rl.zoo import ConvNeXtLike, ScalarLoss

    torch.manual_seed(0)
    return ScalarLoss(ConvNeXtLike((16, 32), (1, 1)).eval()).eval(), (
        torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
    )


_GPT2_TRAIN = {
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 4,
    "vocab_size": 1000,
    "n_positions": 64,
    "use_cache": False,
}
_BERT_TRAIN = {
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "vocab_size": 1000,
    "max_position_embeddings": 64,
}
_OPT_TRAIN = {
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "ffn_dim": 256,
    "num_attention_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 64,
    "word_embed_proj_dim": 64,
    "use_cache": False,
}
_DISTILBERT_TRAIN = {
    "n_layers": 1,
    "dim": 64,
    "hidden_dim": 256,
    "n_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 64,
}


def _random_family(count: int) -> list[tuple[str, Builder]]:
    return [(f"random-{i}", (lambda i=i: random_graph(i, size=16 + 4 * (i % 4)))) for i in range(count)]


FAMILIES: dict[str, list[tuple[str, Builder]]] = {
    "mlp": [
        ("mlp-relu-64", mlp(64, "relu")),
        ("mlp-gelu-32", mlp(32, "gelu")),
        ("mlp-gated-32", mlp(32, "gated", 2)),
    ],
    "gpt2": [
        ("gpt2-l1-w64-s8", gpt2(1, 64, 8)),
        ("gpt2-l2-w64-s16-eager", gpt2(2, 64, 16, "eager")),
        ("gpt2-l2-w128-s16", gpt2(2, 128, 16)),
        ("gpt2-l3-w96-s32-eager", gpt2(3, 96, 32, "eager")),
    ],
    "bert": [
        ("bert-l1-w64-s8", bert(1, 64, 8)),
        ("bert-l2-w64-s16-eager", bert(2, 64, 16, "eager")),
        ("bert-l2-w128-s16", bert(2, 128, 16)),
    ],
    "cnn": [("small-cnn", small_cnn), ("resnet18-32", resnet18(32)), ("resnet18-64", resnet18(64))],
    "decomposed": [
        ("gpt2-l1-w64-s8-decomposed", decomposed(gpt2(1, 64, 8))),
        ("bert-l2-w64-s16-decomposed", decomposed(bert(2, 64, 16, "eager"))),
        ("mlp-gated-32-decomposed", decomposed(mlp(32, "gated", 2))),
    ],
    "training": [
        ("mlp-gelu-32-train", training(_mlp_loss)),
        ("gpt2-l1-w64-s8-train", training(_gpt2_loss)),
        (
            "gpt2-l2-w64-s16-train",
            training(_loss_of(_hf("GPT2Config", "GPT2LMHeadModel", 16, **_GPT2_TRAIN))),
        ),
        ("bert-l1-w64-s16-train", training(_loss_of(_hf("BertConfig", "BertModel", 16, **_BERT_TRAIN)))),
        ("small-cnn-train", training(_cnn_loss)),
    ],
    "random": _random_family(12),
    "opt": [
        ("opt-l1-w64-s8", opt(1, 64, 8)),
        ("opt-l2-w64-s16", opt(2, 64, 16)),
        ("opt-l1-w64-s16-train", training(_loss_of(_hf("OPTConfig", "OPTForCausalLM", 16, **_OPT_TRAIN)))),
    ],
    "distilbert": [
        ("distilbert-l1-w64-s8", distilbert(1, 64, 8)),
        ("distilbert-l2-w128-s16", distilbert(2, 128, 16)),
        (
            "distilbert-l1-w64-s16-train",
            training(_loss_of(_hf("DistilBertConfig", "DistilBertModel", 16, **_DISTILBERT_TRAIN))),
        ),
    ],
    "convnext": [
        ("convnext-tiny-32", convnext((16, 32), (1, 1), 32)),
        ("convnext-small-64", convnext((16, 32, 64), (1, 2, 1), 64)),
        ("convnext-tiny-32-train", training(_convnext_loss)),
    ],
}
"""Builders per family, first builder = the ``small`` corpus."""

UNCACHED_FAMILIES = ("random",)
"""Families cheap enough to build every time (no capture)."""


def family_split(family: str) -> str:
    return "heldout" if family in HELDOUT_FAMILIES else "train"


# ------------------------------------------------------------------------ disk cache
def default_cache_dir() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")


def fingerprint_sources(family: str | None = None) -> list[Path]:
    """The kiln sources a family's graphs depend on: the torch frontend (capture and ATen
    rules), the corpus builders and the ``decompose`` pass, and for ``training`` also the
    autodiff pass and the op declarations.  Every one exists (a moved file is an error here,
    not a cache that silently stops noticing changes)."""
    kiln_root = Path(__file__).resolve().parents[2]
    sources = sorted((kiln_root / "frontends" / "torch").glob("*.py"))
    sources += [Path(__file__), Path(__file__).with_name("zoo.py"), kiln_root / "passes" / "decompose.py"]
    if family == "training":
        sources += [kiln_root / "passes" / "autodiff.py"] + sorted((kiln_root / "ir" / "ops").glob("*.py"))
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"corpus fingerprint: missing source(s) {', '.join(missing)}")
    return sources


def fingerprint(family: str | None = None) -> str:
    """Hash of what a family's graphs depend on: library versions and the text of
    :func:`fingerprint_sources`."""
    import torch

    parts = [CORPUS_VERSION, torch.__version__]
    try:
        import transformers

        parts.append(transformers.__version__)
    except ImportError:
        parts.append("no-transformers")
    parts += [path.read_text() for path in fingerprint_sources(family)]
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=8).hexdigest()


def load_graph(name: str, builder: Builder, cache_dir: Path | None, family: str | None = None) -> Graph:
    """The graph ``builder`` makes, read from the disk cache when present (then written)."""
    if cache_dir is None:
        return builder()
    path = cache_dir / "corpus" / fingerprint(family) / f"{name}.kir"
    if path.exists():
        try:
            return parse(path.read_text())
        except KilnError:
            pass  # written by an older kiln whose ops differ: rebuild
    graph = builder()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(str(graph))
    tmp.replace(path)
    return graph


def build_corpus(
    families: Sequence[str] | None = None,
    *,
    split: str | None = None,
    size: str = "full",
    cache_dir: str | Path | None = "default",
    skip_unavailable: bool = True,
) -> list[CorpusEntry]:
    """Corpus entries of ``families`` (default: all) in ``split`` (default: both).

    ``size="small"`` keeps one graph per family.  ``cache_dir=None`` disables the disk
    cache; ``"default"`` uses :func:`default_cache_dir`.  A family whose builder cannot run
    (``training`` without the autodiff pass, models needing ``transformers`` without it) is
    skipped when ``skip_unavailable``, else its error is raised.
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose {' or '.join(SPLITS)}")
    if size not in ("small", "full"):
        raise ValueError(f"size must be 'small' or 'full', got {size!r}")
    chosen = list(FAMILIES) if families is None else list(families)
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown corpus families {unknown}; known: {', '.join(FAMILIES)}")
    root = default_cache_dir() if cache_dir == "default" else (Path(cache_dir) if cache_dir else None)
    entries = []
    for family in chosen:
        if split is not None and family_split(family) != split:
            continue
        builders = FAMILIES[family][:1] if size == "small" else FAMILIES[family]
        for name, builder in builders:
            try:
                graph = load_graph(name, builder, None if family in UNCACHED_FAMILIES else root, family)
            except (ImportError, KilnError) as error:
                # ImportError: transformers or the autodiff pass is missing; KilnError: the
                # autodiff pass lacks a gradient rule this model needs
                if not skip_unavailable or (isinstance(error, KilnError) and family != "training"):
                    raise
                warnings.warn(f"corpus: skipping {name}: {error}", stacklevel=2)
                continue
            entries.append(CorpusEntry(name, family, family_split(family), graph))
    return entries
