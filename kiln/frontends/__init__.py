"""Frontends: from a framework's program to kiln's graph IR.

* :mod:`kiln.frontends.torch` -- PyTorch: ``torch.export`` capture, the ATen rules, the
  ``torch.compile`` backend, per-op fallback and the autograd integration.

Errors every frontend raises are in :mod:`kiln.frontends.errors`.
"""
