"""The PyTorch frontend.

* :mod:`.capture` -- ``torch.export`` to an ATen FX graph, and the FX graph to a kiln graph;
* :mod:`.aten` and the ``aten_*`` modules -- one lowering rule per ATen op family;
* :mod:`.capture_cache`, :mod:`.fingerprint` -- the capture cache and its key;
* :mod:`.dynamo` -- the ``"kiln"`` backend of ``torch.compile``;
* :mod:`.fallback` -- per-op fallback: unsupported nodes run in PyTorch;
* :mod:`.autograd` -- compiled graphs as ``torch.autograd.Function`` s.
"""
