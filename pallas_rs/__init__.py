"""pallas_rs: fused matmul + reduce-scatter for tensor-parallel row-parallel layers.

Public API (flat re-exports):

  matmul_reduce_scatter            inside `jax.shard_map`, per-device arrays.
  row_parallel_matmul              global arrays, applies jit + shard_map.
  all_gather_matmul                inside `jax.shard_map`: the mirror op, all_gather(lhs) @ rhs.
  reference_matmul_reduce_scatter  the XLA composition (oracle and fallback).
  Config                           the fused kernel's tuning config.
  shapes                           the named shape table for tests and experiments.

The package in layers (docs/design.md section 1): this folder is what a user calls (api, vjp,
model, platform, reference); `pallas_rs.tuning` decides (the gate, the tuning table: `use_table`,
`load_table`); `pallas_rs.kernel` is the fused kernels; `pallas_rs.bench` holds the helpers of
tests and experiments. Subpackages and modules such as `pallas_rs.tuning` and `pallas_rs.model`
are reachable as attributes after `import pallas_rs`; they are imported on first use, so that
`import pallas_rs` stays free of the Mosaic GPU import chain and of the bench helpers.
"""
import importlib

from pallas_rs.api import all_gather_matmul
from pallas_rs.api import matmul_reduce_scatter
from pallas_rs.api import row_parallel_matmul
from pallas_rs.reference import matmul_reduce_scatter as reference_matmul_reduce_scatter

__all__ = [
    "Config",
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "reference_matmul_reduce_scatter",
    "row_parallel_matmul",
    "shapes",
]

_SUBMODULES = frozenset({"api", "bench", "kernel", "model", "platform", "reference", "tuning",
                         "vjp"})


def __getattr__(name):
  if name == "Config":
    from pallas_rs.kernel.config import Config  # pylint: disable=g-import-not-at-top
    return Config
  if name == "shapes":
    return importlib.import_module("pallas_rs.bench.shapes")
  if name in _SUBMODULES:
    return importlib.import_module(f"pallas_rs.{name}")
  raise AttributeError(f"module 'pallas_rs' has no attribute {name!r}")
