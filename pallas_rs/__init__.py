"""pallas_rs: fused matmul + reduce-scatter for tensor-parallel row-parallel layers.

Public API (flat re-exports):

  matmul_reduce_scatter            inside `jax.shard_map`, per-device arrays.
  row_parallel_matmul              global arrays, applies jit + shard_map.
  reference_matmul_reduce_scatter  the XLA composition (oracle and fallback).
  Config                           the fused kernel's tuning config.
  shapes                           the named shape table for tests and experiments.
"""
from pallas_rs import shapes
from pallas_rs.api import matmul_reduce_scatter
from pallas_rs.api import row_parallel_matmul
from pallas_rs.reference import matmul_reduce_scatter as reference_matmul_reduce_scatter

__all__ = [
    "Config",
    "matmul_reduce_scatter",
    "reference_matmul_reduce_scatter",
    "row_parallel_matmul",
    "shapes",
]


def __getattr__(name):
  # Config lives with the kernel (pallas_rs/config.py); importing it lazily keeps
  # `import pallas_rs` free of the Mosaic GPU import chain.
  if name == "Config":
    from pallas_rs.config import Config  # pylint: disable=g-import-not-at-top
    return Config
  raise AttributeError(f"module 'pallas_rs' has no attribute {name!r}")
