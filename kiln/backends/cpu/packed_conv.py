"""oneDNN convolutions with prepacked weights, and inference batch norm folded into them.

* :class:`PackedConv`: a 2-d or 3-d float32 convolution through oneDNN
  (``mkldnn._convolution_pointwise``) whose weight is reordered into oneDNN's blocked layout
  once and reused while the weight is unchanged; optionally with oneDNN's fused ``relu``,
  and a residual added before it (oneDNN's binary ``add`` post-op).
  ``F.conv2d``/``F.conv3d`` reorder the weight at every call: skipping that saves about a
  quarter of the time of 512-channel 2-d layers, and half to two thirds of small 3-d ones.
* :class:`BatchNormFolded`: a convolution followed by inference batch norm
  (``batch_norm(conv(x, w, b), gamma, beta, mean, var)``), run as one convolution with the
  folded weight ``w * gamma / sqrt(var + eps)`` (per output channel) and bias
  ``(b - mean) * gamma / sqrt(var + eps) + beta``.

Both read parameters live, as kiln promises: a prepared copy is made again when a tensor it
was made from is another tensor (another storage address, for ``PackedConv``) or has a new
version counter, so an in-place update (an optimizer step, ``load_state_dict``) or a new
tensor is seen at the next call; inference tensors, which have no version counter, are
prepared at every call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

_REORDER = {2: "mkldnn_reorder_conv2d_weight", 3: "mkldnn_reorder_conv3d_weight"}

POST_OPS = ("none", "relu")
"""The elementwise operations oneDNN applies to a :class:`PackedConv` result in place."""


def packed_conv_available(spatial: int) -> bool:
    """Whether this torch has oneDNN's pointwise convolution and weight reorder for
    ``spatial``-d convolutions."""
    return (spatial in _REORDER and torch.backends.mkldnn.is_available()
            and hasattr(torch._C._nn, _REORDER[spatial]) and hasattr(torch.ops.mkldnn, "_convolution_pointwise"))


def version_key(tensors: Sequence[torch.Tensor | None]) -> tuple | None:
    """What identifies the contents of ``tensors``: storage addresses and version counters;
    ``None`` (never reused) when one is an inference tensor, which has no version counter.
    A holder of a key keeps the tensors too: a freed tensor's address and version 0 are
    soon a new tensor's (a weight timed on random data, then the real one)."""
    if any(t is not None and t.is_inference() for t in tensors):
        return None
    return tuple((t.data_ptr(), t._version) if t is not None else None for t in tensors)


def _versions(tensors: Sequence[torch.Tensor | None]) -> tuple | None:
    """The version counters of ``tensors``; ``None`` when one is an inference tensor."""
    try:
        return tuple(t._version for t in tensors if t is not None)
    except RuntimeError:
        return None


class PackedConv:
    """A 2-d or 3-d float32 convolution through oneDNN with its weight prepacked (see the
    module docstring); ``post`` is one of :data:`POST_OPS`.  Called as ``(x, w, b=None,
    residual=None)``: with a residual (the result's shape), oneDNN computes
    ``post(conv(x, w) + b + residual)`` in one call (its binary ``add`` post-op), so a ResNet
    block's sum and ReLU make no pass of their own over the result."""

    def __init__(self, input_shape: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
                 dilation: tuple[int, ...], groups: int, post: str = "none"):
        if post not in POST_OPS:
            raise ValueError(f"unknown oneDNN post-op {post!r}; known: {', '.join(POST_OPS)}")
        self.input_shape = input_shape
        self.args = (list(padding), list(stride), list(dilation), groups)
        self.post = post
        self._reorder = getattr(torch._C._nn, _REORDER[len(stride)])
        self._packed: tuple[tuple | None, torch.Tensor, torch.Tensor] | None = None
        self._lock = threading.Lock()

    def _weight(self, w: torch.Tensor) -> torch.Tensor:
        key = version_key([w])
        packed = self._packed
        if packed is not None and key is not None and packed[0] == key:
            return packed[1]
        with self._lock:
            padding, stride, dilation, groups = self.args
            weight = self._reorder(w.detach().contiguous().to_mkldnn(), padding, stride, dilation, groups,
                                   list(self.input_shape))
            self._packed = (key, weight, w)  # w kept: see version_key
        return weight

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        padding, stride, dilation, groups = self.args
        if residual is not None:
            return torch.ops.mkldnn._convolution_pointwise.binary(
                x, residual, self._weight(w), b, padding, stride, dilation, groups, "add", None,
                None if self.post == "none" else self.post, [], "")
        return torch.ops.mkldnn._convolution_pointwise(x, self._weight(w), b, padding, stride, dilation, groups,
                                                       self.post, [], "")


def fold_batch_norm(w: torch.Tensor, b: torch.Tensor | None, gamma: torch.Tensor, beta: torch.Tensor,
                    mean: torch.Tensor, var: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and bias of a convolution (weight ``w``, bias ``b`` or ``None``) followed by
    an inference batch norm: ``w * s`` per output channel and ``b * s + beta - mean * s``, with
    ``s = gamma / sqrt(var + eps)``; both contiguous."""
    scale = gamma.float() * torch.rsqrt(var.float() + eps)
    weight = (w * scale.reshape(-1, *([1] * (w.dim() - 1)))).contiguous()
    shift = beta.float() - mean.float() * scale
    return weight, (shift if b is None else b * scale + shift).contiguous()


class BatchNormFolded:
    """``conv`` (called as ``(x, w, b)``, or ``(x, w, b, residual)``) followed by inference
    batch norm, as one call of ``conv`` with folded weights (see the module docstring).
    Called as ``(x, w, [b,] gamma, beta, mean, var, [residual])``; ``has_bias`` says whether
    ``b`` is there, ``has_residual`` whether ``residual`` is (passed on to ``conv``)."""

    def __init__(self, conv: Callable[..., torch.Tensor], has_bias: bool, eps: float, has_residual: bool = False):
        self.conv = conv
        self.has_bias = has_bias
        self.has_residual = has_residual
        self.eps = float(eps)
        self._folded: tuple[tuple[tuple, tuple | None], torch.Tensor, torch.Tensor] | None = None
        self._lock = threading.Lock()

    def folded(self, w: torch.Tensor, b: torch.Tensor | None, gamma: torch.Tensor, beta: torch.Tensor,
               mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The folded weight and bias, made again only when one of the tensors changed."""
        tensors = (w, b, gamma, beta, mean, var)
        found = self._folded
        versions = _versions(tensors)
        if found is not None and versions is not None:  # cheaply: the same tensors, unchanged
            sources, known = found[0]
            if known == versions and all(t is u for t, u in zip(tensors, sources)):
                return found[1], found[2]
        # made outside inference mode, so that the folded weight has a version counter and a
        # packed copy of it can be reused
        with self._lock, torch.inference_mode(False), torch.no_grad():
            weight, bias = fold_batch_norm(w, b, gamma, beta, mean, var, self.eps)
            # the tensors are kept, so a new tensor cannot take the address and version of a
            # freed one unnoticed
            self._folded = ((tensors, versions), weight, bias)
        return weight, bias

    def __call__(self, x: torch.Tensor, w: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        residual = (rest[-1],) if self.has_residual else ()
        rest = rest[:-1] if self.has_residual else rest
        b, stats = (rest[0], rest[1:]) if self.has_bias else (None, rest)
        weight, bias = self.folded(w, b, *stats)
        return self.conv(x, weight, bias, *residual)


__all__ = ["POST_OPS", "BatchNormFolded", "fold_batch_norm", "PackedConv", "packed_conv_available", "version_key"]
