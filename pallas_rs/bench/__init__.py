"""Helpers of the tests and the experiments, apart from what a user imports (the user layer
and `pallas_rs.tuning` / `pallas_rs.kernel` never import this package).

  shapes.py    the named shape table: seed, proxy8 and CI cases (also `pallas_rs.shapes`)
  testing.py   the one input generator (global x, w; per-rank view; on a mesh), fast references
  numerics.py  bit-exact numpy emulations of the fused and unfused reduce, the error rule
  timing.py    device timers for the experiments: one function's calls
  cupti.py     CUPTI records paired with their devices and calls
  alternating.py  several functions timed in turn (rounds, call by call), for comparisons
"""
