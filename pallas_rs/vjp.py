"""Custom VJP shared by every implementation of matmul + reduce-scatter.

Forward `y = reduce_scatter(x @ w)` along `scatter_dimension`; with the
cotangent `dy` of this device's chunk and `dy_full = all_gather(dy)` (the
cotangent of the full, unscattered product):

  dx = dy_full @ w.T      [m, n] @ [n, k_shard]
  dw = x.T @ dy_full      [k_shard, m] @ [m, n]

`dy` is [m // D, n] for scatter_dimension=0 (gathered along rows) and
[m, n // D] for scatter_dimension=1 (gathered along columns); the formulas are
the same once gathered. Residuals are the operands only.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

from pallas_rs import reference


def all_gather_matmul(lhs: jax.Array, rhs: jax.Array, axis_name, *,
                      gather_dimension: int = 0,
                      out_dtype=None) -> tuple[jax.Array, jax.Array]:
  """`all_gather(lhs) @ rhs` with fp32 accumulation; call inside shard_map.

  The mirror image of matmul + reduce-scatter, kept separate so that a fused
  all-gather matmul kernel can replace it.

  Args:
    lhs: [m // D, n] (gather_dimension=0) or [m, n // D] (gather_dimension=1).
    rhs: [n, p].
    axis_name: the mesh axis to gather over.
    gather_dimension: the dimension of `lhs` to gather.
    out_dtype: dtype of the product; defaults to `lhs.dtype`.

  Returns:
    (`all_gather(lhs) @ rhs` [m, p], the gathered `lhs` [m, n]); the gathered
    operand is returned so that the caller's second matmul does not gather again.
  """
  lhs_full = lax.all_gather(lhs, axis_name, axis=gather_dimension, tiled=True)
  out = jnp.dot(lhs_full, rhs, preferred_element_type=jnp.float32)
  return out.astype(out_dtype or lhs.dtype), lhs_full


def _forward(x, w, axis_name, scatter_dimension, implementation, config):
  if implementation == "xla":
    return reference.matmul_reduce_scatter(
        x, w, axis_name=axis_name, scatter_dimension=scatter_dimension)
  if implementation == "fused":
    from pallas_rs import fused  # pylint: disable=g-import-not-at-top
    assert scatter_dimension == 0, scatter_dimension  # api.py rejects others.
    return fused.fused_matmul_reduce_scatter(
        x, w, axis_name=axis_name, num_devices=lax.axis_size(axis_name),
        config=config)
  raise AssertionError(f"unresolved {implementation=}")  # api.py resolves it.


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def matmul_reduce_scatter(x, w, axis_name, scatter_dimension, implementation,
                          config):
  """Differentiable matmul + reduce-scatter; `implementation` is "xla"|"fused"."""
  return _forward(x, w, axis_name, scatter_dimension, implementation, config)


def _fwd(x, w, axis_name, scatter_dimension, implementation, config):
  y = _forward(x, w, axis_name, scatter_dimension, implementation, config)
  return y, (x, w)


def _bwd(axis_name, scatter_dimension, implementation, config, res, dy):
  del config  # The forward's kernel config does not apply to the all-gather matmul.
  x, w = res
  if implementation == "fused":
    # The forward ran the fused kernel (asked for, or chosen by "auto" from a measurement):
    # overlap the backward's all-gather matmul too (jax's collective_matmul_mgpu where it
    # applies, else XLA with the reason logged once). An XLA forward keeps an XLA backward.
    from pallas_rs import ag_matmul  # pylint: disable=g-import-not-at-top  (ag_matmul -> api -> vjp)
    dx, dy_full = ag_matmul.all_gather_matmul(
        dy, w.T, axis_name, gather_dimension=scatter_dimension, out_dtype=x.dtype,
        implementation="auto")
  else:
    dx, dy_full = all_gather_matmul(dy, w.T, axis_name, gather_dimension=scatter_dimension,
                                    out_dtype=x.dtype)
  dw = jnp.dot(x.T, dy_full, preferred_element_type=jnp.float32)
  return dx, dw.astype(w.dtype)


matmul_reduce_scatter.defvjp(_fwd, _bwd)
