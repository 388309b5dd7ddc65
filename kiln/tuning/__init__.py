"""Tuning: the layer that searches for better decisions than the defaults by running code.

* :mod:`kiln.tuning.measure` -- timing (:func:`~kiln.runtime.timing.best_time`, the one loop
  every timer uses, re-exported), the measured cost of a graph, the per-call overhead of an
  executable and kernel profiles of a call plan;
* :mod:`kiln.tuning.schedules` -- the runtime of a loop program's generated C, and datasets
  of timed random schedules;
* :mod:`kiln.tuning.rl` -- the reinforcement-learning tools for pass ordering (corpus,
  gymnasium environment, costs with the measured one, baselines, training, evaluation).

It sits above the backends and the frontends and below :mod:`kiln.compiler`: it imports
neither :mod:`kiln.compiler` nor the ``kiln`` package, and no lower layer imports it (a
compile never needs it).  See ``docs/tuning.md``.
"""
