"""The device-neutral core every code-generating backend builds on (``docs/backends.md``).

* :mod:`.select` -- implementation selection (rule, generated, timed) over a backend's
  :class:`~.select.Selection` (its library table is a hook); :mod:`.choices` persists timed
  choices;
* :mod:`.library` -- the library-call record and the zero-copy torch views;
* :mod:`.partition` -- the graph partitioned into kernels, library calls, views, copies,
  packs and releases, on slots with predicted layouts; liveness of buffers;
* :mod:`.absorb` -- strided views absorbed into the kernels that read them;
* :mod:`.memory_plan` -- liveness-based arena planning;
* :mod:`.build` -- the pipeline (cache lookup, lower, compile, load, bind a
  :class:`kiln.runtime.call_plan.CallPlan`) with the hooks a backend fills;
* :mod:`.toolchain` -- the toolchain protocol and the artifact cache of compiled sources.

These modules import only :mod:`kiln.ir`, :mod:`kiln.passes`, :mod:`kiln.runtime`,
:mod:`kiln.backends.base` and each other; nothing here names a device's specifics.
"""
