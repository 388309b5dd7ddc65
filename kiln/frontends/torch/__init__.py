"""The PyTorch frontend: PyTorch programs to kiln graphs.

* :mod:`.capture` -- ``torch.export`` of a module (decomposed only when kiln needs it) and
  the ATen FX graph to a kiln graph; :mod:`.lowering` -- the node-by-node lowering under it;
* :mod:`.aten` and the ``aten_*`` modules -- one lowering rule per ATen op family, each rule
  declaring its facts (kept whole, fresh result); :mod:`.aten_support` -- argument binding
  and the "does kiln lower this node?" test;
* :mod:`.capture_cache`, :mod:`.fingerprint`, :mod:`.describe` -- the capture cache and its
  key, a description of everything a program's code can read;
* :mod:`.dynamo` -- the ``"kiln"`` backend of ``torch.compile`` and its registration;
  :mod:`.tracing` -- ``make_fx`` tracing to functional ATen graphs;
* :mod:`.autograd_function` -- ``torch.autograd.Function`` calls kept with their own
  backward (under ``torch.compile`` and ``torch.export``);
* :mod:`.fallback` -- per-op fallback: unsupported nodes run in PyTorch;
* :mod:`.autograd` -- compiled graphs as ``torch.autograd.Function`` s.

It imports the IR, passes, runtime and backends only, never :mod:`kiln.compiler`.
"""
