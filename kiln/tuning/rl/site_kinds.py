"""Per-site action kinds besides fuse-or-not: duplicate a producer, a layout per conv/matmul,
rematerialize a value (``kiln/DuplicateSites-v0``, ``kiln/LayoutSites-v0``,
``kiln/RematSites-v0``).

Each kind is a :class:`~kiln.tuning.rl.site_env.DecisionSites` (a fixed list of sites in
graph order, answered yes or no; the all-no vector is exactly the default) and a
:class:`~kiln.tuning.rl.site_env.DecisionSitesEnv`:

* :class:`DuplicateSites`: sites are the cheap producers (fusion class ``elementwise``,
  ``view`` or ``creation``) of the graph ``fuse`` sees in the default pipeline's first round
  (as :class:`~kiln.tuning.rl.sites.FusionSites`' ``pre``) whose results several nodes read
  and that produce no graph output.  Yes: the producer is cloned once per reader (later
  producers first, so a duplicated chain is cloned whole), so each reader's fused kernel can
  recompute it instead of reading a materialized value; then the fusion walk, ``fuse_groups``
  and the default pipeline's later rounds without ``fuse`` run.  A clone left outside any
  fused kernel is merged back by CSE.  Rewards: ``"measured"``, ``"arena"``, ``"kernels"``
  (the relative kernel-count decrease, cheap).
* :class:`LayoutSites`: on the default pipeline's graph, sites are its convolutions (``conv``
  nodes and ``fused`` nodes anchored on one, 4-d or 5-d results), then the params matmuls
  read as their right operand (through views; one site per param, since the cpu backend
  packs a param once for all its GEMMs).  Yes: the convolution's result stays NCHW (cpu
  option ``nchw_convs``) instead of channels-last; the GEMMs read the weight in place
  (cpu option ``updated_params``) instead of from a packed copy.  Rewards: ``"measured"``,
  ``"arena"``.
* :class:`RematSites`: on a joint (forward + backward) training graph after the default
  pipeline without ``fuse``, sites are the forward values ``remat`` may recompute
  (:func:`kiln.passes.remat.recomputation_candidates`).  Yes: recompute it in the backward
  (:func:`~kiln.passes.remat.rematerialize` with ``recompute=``), then ``fuse`` (the route
  of ``kiln.compile_train(..., remat=True)``); the all-no vector is the default pipeline's
  graph (``remat=False``), and :attr:`RematSites.min_cut` is the vector of remat's own
  choice.  Builds pass every param as ``updated_params`` (a training step's weights).
  Rewards: ``"measured"`` (speedup minus ``memory_weight`` (default 1) times the relative
  change of the planned peak), ``"arena"`` (the memory term, built, not timed),
  ``"memory"`` (the memory term from :func:`~kiln.tuning.rl.site_env.liveness_peak`, cheap).

::

    import gymnasium, kiln.tuning.rl
    env = gymnasium.make("kiln/RematSites-v0", reward="memory", memory_weight=1.0)
    obs, info = env.reset(seed=0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from kiln.ir import Graph, Node, Value
from kiln.ir.sizes import estimated_nbytes
from kiln.passes.fusion import ANCHORS, Fuse, fuse_groups, kernel_count, node_class, partition
from kiln.passes.manager import PassManager
from kiln.passes.pipeline import DEFAULT_PIPELINE, default_pipeline
from kiln.passes.remat import recomputation_candidates, recomputed_names, rematerialize
from kiln.tuning.rl.site_env import COMMON_FEATURES, DecisionSites, DecisionSitesEnv, liveness_peak, log_feature

CHEAP_CLASSES = ("elementwise", "view", "creation")


def _readers(graph: Graph) -> dict[Node, list[Node]]:
    """Each node's distinct reader nodes, in graph order."""
    out: dict[Node, list[Node]] = {n: [] for n in graph.nodes}
    for n in graph.nodes:
        for p in dict.fromkeys(v.producer for v in n.inputs if v.producer is not None):
            out[p].append(n)
    return out


# ---------------------------------------------------------------------------- duplicate
class DuplicateSites(DecisionSites):
    """Duplicate a cheap producer per reader, or not (module docstring)."""

    kind: ClassVar[str] = "duplicate"
    FEATURES: ClassVar[tuple[str, ...]] = (
        *(f"producer_{c}" for c in CHEAP_CLASSES), "log_numel", "readers", "anchor_readers", "groupable_readers",
        "operands", "param_operands", *COMMON_FEATURES)

    def __init__(self, graph: Graph, *, max_nodes: int = 32, strategy: str = "greedy", name: str | None = None):
        super().__init__(graph, name)
        self.max_nodes, self.strategy = max_nodes, strategy
        self.pre = PassManager(DEFAULT_PIPELINE.removesuffix(",fuse"), verify=True).run(graph).graph
        readers = _readers(self.pre)
        returned = {v.producer for v in self.pre.outputs}
        pos = {n: i for i, n in enumerate(self.pre.nodes)}
        self.nodes = [n for n in self.pre.nodes if node_class(n) in CHEAP_CLASSES and len(readers[n]) > 1
                      and n not in returned and n.outputs]
        self.readers = readers
        self.params = set(self.pre.params)
        self.sites = [n.outputs[0].name for n in self.nodes]
        self.positions = [pos[n] / max(1, len(self.pre.nodes)) for n in self.nodes]
        self._graphs: dict[tuple[bool, ...], Graph] = {}

    def site_features(self, index: int) -> list[float]:
        n = self.nodes[index]
        readers = self.readers[n]
        classes = [node_class(r) for r in readers]
        return [*(float(node_class(n) == c) for c in CHEAP_CLASSES), log_feature(n.outputs[0].type.numel),
                min(1.0, len(readers) / 8), sum(c in ANCHORS for c in classes) / len(readers),
                sum(c in ("elementwise", "view", *ANCHORS) for c in classes) / len(readers),
                min(1.0, len(n.inputs) / 4), sum(v in self.params for v in n.inputs) / max(1, len(n.inputs))]

    def duplicated(self, decisions: Sequence[bool]) -> Graph:
        """:attr:`pre` with the chosen producers cloned per reader (the graph the walk sees)."""
        chosen = set(self.chosen(decisions))
        if not chosen:
            return self.pre
        g, vmap = self.pre.clone_with_map()
        taken = {v.name for v in g.values()}
        for node in reversed(list(g.nodes)):
            if not node.outputs or node.outputs[0].name not in chosen:
                continue
            readers = _readers(g)[node]
            for k, reader in enumerate(readers[1:], start=1):
                names = []
                for v in node.outputs:
                    name, j = f"dup{k}.{v.name}", k
                    while name in taken:
                        j += len(readers)
                        name = f"dup{j}.{v.name}"
                    taken.add(name)
                    names.append(name)
                copy = g.add_node(node.op, list(node.inputs), node.attrs, names=names, loc=node.loc)
                swap = dict(zip(node.outputs, copy.outputs))
                reader.inputs = tuple(swap.get(v, v) for v in reader.inputs)
        g.sort()
        return g

    def build(self, decisions: Sequence[bool]) -> tuple[Graph, dict[str, Any]]:
        key = self.key(decisions)
        if key not in self._graphs:
            g = self.duplicated(key)
            groups = partition(g, self.max_nodes, self.strategy)
            fused = fuse_groups(g, groups) if groups else g
            self._graphs[key] = default_pipeline(fuse=False, max_iterations=3).run(fused).graph
        return self._graphs[key], {}

    def default_build(self) -> tuple[Graph, dict[str, Any]]:
        if self._default is None:
            self._default = (default_pipeline().run(self.source).graph, {})
        return self._default

    def cheap_reward(self, kind: str, memory_weight: float) -> Callable[[Sequence[bool]], float]:
        if kind != "kernels":
            return super().cheap_reward(kind, memory_weight)
        base = kernel_count(self.default_build()[0])
        return lambda decisions: (base - kernel_count(self.graph(decisions))) / max(1, base)


# ---------------------------------------------------------------------------- layout
def _through_views(value: Value) -> Value:
    while value.producer is not None and node_class(value.producer) == "view" and value.producer.inputs:
        value = value.producer.inputs[0]
    return value


def _conv_anchor(node: Node) -> bool:
    if node.op_name == "conv":
        return True
    return node.op_name == "fused" and node.attrs.get("template") == "conv"


def _matmul_weight(node: Node) -> Value | None:
    """The outer value a matmul (or matmul-anchored fused node) reads as its right operand,
    followed through views."""
    if node.op_name == "matmul":
        return _through_views(node.inputs[1])
    if node.op_name != "fused" or node.attrs.get("template") != "matmul":
        return None
    body: Graph = node.attrs["body"]
    anchor = next((n for n in body.nodes if n.op_name == "matmul"), None)
    if anchor is None:
        return None
    inner = _through_views(anchor.inputs[1])
    if inner not in body.inputs:
        return None
    return _through_views(node.inputs[body.inputs.index(inner)])


class LayoutSites(DecisionSites):
    """A layout per convolution (NCHW or channels-last) and per matmul weight (in place or
    packed) of the default pipeline's graph (module docstring)."""

    kind: ClassVar[str] = "layout"
    FEATURES: ClassVar[tuple[str, ...]] = (
        "conv", "matmul", "fused", "log_result_numel", "log_weight_numel", "channels", "log_rows", "readers",
        *COMMON_FEATURES)

    def __init__(self, graph: Graph, *, name: str | None = None):
        super().__init__(graph, name)
        self.default = default_pipeline().run(graph).graph
        nodes = self.default.nodes
        readers = _readers(self.default)
        params = set(self.default.params)
        self.kinds: list[str] = []
        self.nodes: list[Node] = []
        for i, n in enumerate(nodes):
            if _conv_anchor(n) and n.outputs and n.outputs[0].type.rank in (4, 5):
                self.sites.append(n.outputs[0].name)
                self.kinds.append("conv")
                self.nodes.append(n)
                self.positions.append(i / len(nodes))
        weight_readers: dict[str, list[Node]] = {}
        for n in nodes:
            w = _matmul_weight(n)
            if w is not None and w in params:
                weight_readers.setdefault(w.name, []).append(n)
        for name, users in weight_readers.items():
            self.sites.append(name)
            self.kinds.append("matmul")
            self.nodes.append(users[0])
            self.positions.append(nodes.index(users[0]) / len(nodes))
        self.readers = {n: len(readers[n]) for n in nodes}
        self.weight_readers = weight_readers
        self.param_types = {v.name: v.type for v in self.default.params}

    def site_features(self, index: int) -> list[float]:
        n, kind = self.nodes[index], self.kinds[index]
        out = n.outputs[0].type
        if kind == "conv":
            weight = next((v for v in n.inputs[1:2]), None)
            channels = out.shape[1] if isinstance(out.shape[1], int) else 1
            rows = out.numel // max(1, channels) if isinstance(out.numel, int) else 1
            uses = self.readers[n]
        else:
            weight = self.param_types[self.sites[index]]
            channels = out.shape[-1] if out.rank and isinstance(out.shape[-1], int) else 1
            rows = out.numel // max(1, channels) if isinstance(out.numel, int) else 1
            uses = len(self.weight_readers[self.sites[index]])
        wtype = weight.type if isinstance(weight, Value) else weight
        return [float(kind == "conv"), float(kind == "matmul"), float(n.op_name == "fused"), log_feature(out.numel),
                log_feature(wtype.numel if wtype is not None else 1), log_feature(channels, 12), log_feature(rows, 16),
                min(1.0, uses / 8)]

    def options(self, decisions: Sequence[bool]) -> dict[str, Any]:
        """The cpu backend options of ``decisions`` (``{}`` for the default)."""
        key = self.key(decisions)
        convs = tuple(s for s, k, d in zip(self.sites, self.kinds, key) if d and k == "conv")
        weights = tuple(s for s, k, d in zip(self.sites, self.kinds, key) if d and k == "matmul")
        return {**({"nchw_convs": convs} if convs else {}), **({"updated_params": weights} if weights else {})}

    def build(self, decisions: Sequence[bool]) -> tuple[Graph, dict[str, Any]]:
        return self.default, self.options(decisions)

    def default_build(self) -> tuple[Graph, dict[str, Any]]:
        return self.default, {}


# ---------------------------------------------------------------------------- remat
class RematSites(DecisionSites):
    """Recompute a forward value in the backward, or save it (module docstring).

    ``loss`` is the index of the joint graph's loss output (``rematerialize``'s ``loss``);
    ``fuse=False`` leaves the graphs unfused (the peak then shows remat alone)."""

    kind: ClassVar[str] = "remat"
    FEATURES: ClassVar[tuple[str, ...]] = (
        "elementwise", "view", "creation", "copy", "random", "log_bytes", "relative_bytes", "backward_readers",
        "first_backward_use", "min_cut_choice", *COMMON_FEATURES)

    def __init__(self, graph: Graph, *, loss: int = 0, fuse: bool = True, name: str | None = None):
        super().__init__(graph, name)
        self.loss, self.fuse = loss, fuse
        self.pre = default_pipeline(fuse=False).run(graph).graph
        """The joint graph after the default pipeline without ``fuse`` (what ``remat`` sees)."""
        candidates, chosen = recomputation_candidates(self.pre, loss=loss)
        nodes = self.pre.nodes
        pos = {n: i for i, n in enumerate(nodes)}
        self.nodes = candidates
        self.sites = [n.outputs[0].name for n in candidates]
        self.positions = [pos[n] / len(nodes) for n in candidates]
        self.min_cut = tuple(n in chosen for n in candidates)
        """The vector of ``rematerialize``'s own (minimum cut) choice."""
        loss_value = self.pre.outputs[loss]
        forward = self._ancestors(loss_value.producer) if loss_value.producer is not None else set()
        readers = _readers(self.pre)
        self.backward_readers = {n: [r for r in readers[n] if r not in forward] for n in candidates}
        self.bytes = {n: sum(estimated_nbytes(v.type) for v in n.outputs) for n in candidates}
        self.pos = pos
        self._graphs: dict[tuple[bool, ...], Graph] = {}
        self.options = {"updated_params": tuple(v.name for v in self.pre.params)}

    @staticmethod
    def _ancestors(root: Node) -> set[Node]:
        seen, stack = set(), [root]
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(v.producer for v in n.inputs if v.producer is not None)
        return seen

    def key(self, decisions: Sequence[bool]) -> tuple[bool, ...]:
        """The candidates actually recomputed (those the backward uses): equal keys, equal graphs."""
        names = self.chosen(super().key(decisions))
        done = recomputed_names(self.pre, names, loss=self.loss) if names else set()
        return tuple(s in done for s in self.sites)

    def chosen(self, decisions: Sequence[bool]) -> list[Any]:
        return [s for s, d in zip(self.sites, DecisionSites.key(self, decisions)) if d]

    def site_features(self, index: int) -> list[float]:
        n = self.nodes[index]
        traits = n.op.traits
        largest = max(self.bytes.values())
        backward = self.backward_readers[n]
        first = min((self.pos[r] for r in backward), default=self.pos[n])
        return [float("elementwise" in traits or "pointwise" in traits), float("view" in traits),
                float("creation" in traits), float("copy" in traits), float(n.op.has("random")),
                log_feature(self.bytes[n], 32), self.bytes[n] / max(1, largest), min(1.0, len(backward) / 8),
                first / len(self.pre.nodes), float(self.min_cut[index])]

    def build(self, decisions: Sequence[bool]) -> tuple[Graph, dict[str, Any]]:
        key = self.key(decisions)
        if not any(key):
            return self.default_build()
        if key not in self._graphs:
            g, _ = rematerialize(self.pre, loss=self.loss, recompute=self.chosen(key))
            self._graphs[key] = Fuse().run(g).graph if self.fuse else g
        return self._graphs[key], self.options

    def default_build(self) -> tuple[Graph, dict[str, Any]]:
        if self._default is None:
            graph = default_pipeline().run(self.source).graph if self.fuse else self.pre
            self._default = (graph, self.options)
        return self._default

    def cheap_reward(self, kind: str, memory_weight: float) -> Callable[[Sequence[bool]], float]:
        if kind != "memory":
            return super().cheap_reward(kind, memory_weight)
        base = liveness_peak(self.default_build()[0])
        return lambda decisions: 0.0 - memory_weight * (liveness_peak(self.graph(decisions)) / max(1, base) - 1.0)


# ---------------------------------------------------------------------------- environments
def _training_corpus() -> list[Graph]:
    from kiln.tuning.rl.corpus import _cnn_loss, _mlp_loss, training

    graphs = [training(_mlp_loss)(), training(_cnn_loss)()]
    for g, name in zip(graphs, ("mlp-gelu-32-train", "small-cnn-train")):
        g.name = name
    return graphs


class DuplicateSitesEnv(DecisionSitesEnv):
    """``kiln/DuplicateSites-v0``: :class:`DuplicateSites` (default corpus: the random graphs
    of :func:`kiln.tuning.rl.sites.default_site_corpus`)."""

    problem_type = DuplicateSites

    @classmethod
    def default_corpus(cls) -> list[Graph]:
        from kiln.tuning.rl.sites import default_site_corpus

        return default_site_corpus()


class LayoutSitesEnv(DecisionSitesEnv):
    """``kiln/LayoutSites-v0``: :class:`LayoutSites` (default corpus: the pass-ordering
    corpus' small CNN and a ReLU MLP)."""

    problem_type = LayoutSites

    @classmethod
    def default_corpus(cls) -> list[Graph]:
        from kiln.tuning.rl.corpus import mlp, small_cnn

        graphs = [small_cnn(), mlp(64, "relu")()]
        for g, name in zip(graphs, ("small-cnn", "mlp-relu-64")):
            g.name = name
        return graphs


class RematSitesEnv(DecisionSitesEnv):
    """``kiln/RematSites-v0``: :class:`RematSites` (default corpus: the training graphs of a
    GELU MLP and the small CNN); ``memory_weight`` defaults to 1."""

    problem_type = RematSites
    MEMORY_WEIGHT = 1.0

    @classmethod
    def default_corpus(cls) -> list[Graph]:
        return _training_corpus()


__all__ = ["DuplicateSites", "DuplicateSitesEnv", "LayoutSites", "LayoutSitesEnv", "RematSites", "RematSitesEnv"]
