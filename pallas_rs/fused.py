"""Entry points of the fused Mosaic GPU kernel (matmul + reduce-scatter).

Placeholder until the kernel issue lands: every entry point raises
NotImplementedError so that `implementation="auto"` falls back to XLA.
"""
from __future__ import annotations


def check_supported(*, m, k_shard, n, dtype, num_devices, config=None):
  """Raises NotImplementedError/ValueError if the fused kernel cannot take this call."""
  raise NotImplementedError(
      "pallas_rs.fused: the fused Mosaic GPU kernel is not built yet")


def fused_matmul_reduce_scatter(x, w, *, axis_name, num_devices, config=None):
  """Inside shard_map: x [m, k_shard], w [k_shard, n] -> [m // num_devices, n]."""
  raise NotImplementedError(
      "pallas_rs.fused: the fused Mosaic GPU kernel is not built yet")
