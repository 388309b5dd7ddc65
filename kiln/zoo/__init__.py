"""Model-zoo and op-database sweeps: kiln against PyTorch eager on many programs.

A tool above the public API (like ``benchmarks/``): :mod:`kiln.zoo.compare` holds the
comparison rule every sweep and test uses.
"""
