"""Tuning: the layer that searches for better decisions than the defaults by running code.

* :mod:`kiln.tuning.measure` -- timing (one :func:`best_time` that every timer uses) and the
  measured runtime of compiled graphs;
* :mod:`kiln.tuning.rl` -- the reinforcement-learning tools for pass ordering.

It sits above the backends and the frontends and below :mod:`kiln.compiler`; nothing under
it imports it.
"""
