"""Frontends: from a framework's program to kiln's graph IR.

* :mod:`kiln.frontends.torch` -- PyTorch: ``torch.export`` capture, the ATen rules, the
  ``torch.compile`` backend, per-op fallback and the autograd integration.

Shared by every frontend: the errors they raise (:mod:`kiln.frontends.errors`) and the
compile options that are kiln's rather than a backend's, the cache switch
(:mod:`kiln.frontends.options`).  Frontends import the IR, passes, runtime and backends,
never the driver (:mod:`kiln.compiler`) or :mod:`kiln.tuning`.
"""
