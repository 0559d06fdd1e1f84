"""Inputs and references shared by the GPU tests and the one-GPU experiment scripts."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def stacked_inputs(key, num_devices: int, m: int, k_shard: int, n: int,
                   dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
  """Random per-rank operands xs [D, m, k_shard], ws [D, k_shard, n] (never zeros).

  Rank r's x is scaled by 1 + r / D, so a swapped, missing or duplicated rank changes the
  result; w is scaled so that outputs are O(1).
  """
  if isinstance(key, int):
    key = jax.random.key(key)
  kx, kw = jax.random.split(key)
  scale = (1.0 + jnp.arange(num_devices, dtype=jnp.float32) / num_devices)[:, None, None]
  xs = jax.random.normal(kx, (num_devices, m, k_shard), jnp.float32) * scale
  ws = jax.random.normal(kw, (num_devices, k_shard, n), jnp.float32) / np.sqrt(
      k_shard * num_devices)
  return xs.astype(dtype), ws.astype(dtype)


def stacked_reference(xs, ws) -> np.ndarray:
  """[D, m // D, n]: row chunk r of sum_s xs[s] @ ws[s], on the host.

  Per-rank float32 BLAS products (relative error ~1e-6, far below bf16 rounding), summed over
  ranks in float64: fast enough for the full seed shapes, unlike a float64 einsum.
  """
  x = np.asarray(jnp.asarray(xs).astype(jnp.float32))
  w = np.asarray(jnp.asarray(ws).astype(jnp.float32))
  d, m, _ = x.shape
  full = sum(np.matmul(x[r], w[r]).astype(np.float64) for r in range(d))
  return full.reshape(d, m // d, -1)
