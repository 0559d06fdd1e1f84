"""Pure-XLA references: matmul + reduce-scatter, its mirror the all-gather matmul, and oracles.

`matmul_reduce_scatter` has the same signature as `pallas_rs.matmul_reduce_scatter`
(less the implementation choice): it is the `implementation="xla"` path, the
baseline of the experiments, and the oracle of the tests. `all_gather_matmul` is
the XLA path of the all-gather matmul (`pallas_rs.all_gather_matmul`).
"""
from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np


def dot(a: jax.Array, b: jax.Array, out_dtype=None) -> jax.Array:
  """`a @ b` accumulated in fp32 and rounded once to `out_dtype` (default `a.dtype`): the
  unfused path's GEMM, and every XLA baseline's.

  XLA is asked for the output dtype itself, not for an fp32 product and a cast: the cast form
  gives the same values, but XLA runs it as a Triton GEMM with the cast fused or as cuBLAS
  writing fp32 and then a convert kernel, 3-23% slower on every seed GEMM tried on an H100
  (BUILD_NOTES, 2026-12-06, eighty-eighth session).
  """
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  if out_dtype in (jnp.dtype(jnp.float32), jnp.result_type(a, b)):
    return jnp.dot(a, b, preferred_element_type=out_dtype)
  return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(out_dtype)


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, *, axis_name,
                          scatter_dimension: int = 0) -> jax.Array:
  """`psum_scatter(x @ w)`; call inside `jax.shard_map`.

  The per-device product accumulates in fp32 and is rounded to `x.dtype` before
  the reduce-scatter (what users run today: `jnp.dot` then NCCL; `dot`).

  Args:
    x: [m, k_shard], this device's slice of the contraction dimension.
    w: [k_shard, n].
    axis_name: the mesh axis the contraction dimension is sharded over.
    scatter_dimension: 0 to scatter rows (sequence parallelism), 1 columns.

  Returns:
    [m // num_devices, n] for scatter_dimension=0, [m, n // num_devices] for 1:
    chunk `axis_index` of `sum over devices of x @ w`.
  """
  y = dot(x, w)
  return lax.psum_scatter(y, axis_name, scatter_dimension=scatter_dimension,
                          tiled=True)


def all_gather_matmul(lhs: jax.Array, rhs: jax.Array, axis_name, *,
                      gather_dimension: int = 0,
                      out_dtype=None) -> tuple[jax.Array, jax.Array]:
  """`all_gather(lhs) @ rhs` with fp32 accumulation; call inside shard_map.

  The mirror image of matmul + reduce-scatter: the column-parallel layers' forward and the
  row-parallel op's backward (docs/design.md section 1).

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
  return dot(lhs_full, rhs, out_dtype), lhs_full


def numpy_reference(xs, ws, scatter_dimension: int = 0) -> np.ndarray:
  """float64 oracle over the stacked per-device inputs.

  Inputs of any float dtype (bf16 included) convert exactly to float64, so the
  only error left is float64 rounding: negligible next to bf16 or fp32.

  Args:
    xs: [num_devices, m, k_shard], xs[d] is device d's `x`.
    ws: [num_devices, k_shard, n], ws[d] is device d's `w`.
    scatter_dimension: 0 or 1, as in `matmul_reduce_scatter`.

  Returns:
    float64 [num_devices, m // num_devices, n] (or [num_devices, m,
    n // num_devices] for scatter_dimension=1): out[d] is what device d holds.
  """
  xs = np.asarray(xs).astype(np.float64)
  ws = np.asarray(ws).astype(np.float64)
  if xs.ndim != 3 or ws.ndim != 3 or xs.shape[0] != ws.shape[0]:
    raise ValueError(f"expected xs [D, m, k_shard] and ws [D, k_shard, n], got "
                     f"{xs.shape=} {ws.shape=}")
  num_devices = xs.shape[0]
  full = np.einsum("dmk,dkn->mn", xs, ws)
  if full.shape[scatter_dimension] % num_devices:
    raise ValueError(f"{full.shape=} not divisible by {num_devices=} along "
                     f"{scatter_dimension=}")
  return np.stack(np.split(full, num_devices, axis=scatter_dimension))


def max_rel_error(out, ref) -> float:
  """Normwise relative error `max|out - ref| / max|ref|`, computed in float64.

  The denominator is the largest reference magnitude, not each element's own,
  so near-zero reference entries do not blow the figure up; this is the
  "max relative error" of the design's correctness rule (fused <= 1.1x XLA).
  Returns 0.0 when both are all-zero and inf when only `ref` is.
  """
  out = np.asarray(out).astype(np.float64)
  ref = np.asarray(ref).astype(np.float64)
  if out.shape != ref.shape:
    raise ValueError(f"{out.shape=} != {ref.shape=}")
  num = float(np.max(np.abs(out - ref), initial=0.0))
  den = float(np.max(np.abs(ref), initial=0.0))
  if den == 0.0:
    return 0.0 if num == 0.0 else float("inf")
  return num / den


def max_rel_error_on_device(out: jax.Array, ref: jax.Array) -> jax.Array:
  """`max_rel_error` where the arrays live, without copying them to the host.

  The same figure, `max|out - ref| / max|ref|` (0 when both are all-zero, inf when only `ref`
  is, NaN where either holds a NaN), computed in float32: its own relative error (~1e-7) is
  far below bf16's rounding.
  Traceable; any sharding; returns a float32 scalar. For outputs too large or too many to
  copy (seed shapes on several GPUs, stress loops).
  """
  out = jnp.asarray(out).astype(jnp.float32)
  ref = jnp.asarray(ref).astype(jnp.float32)
  if out.shape != ref.shape:
    raise ValueError(f"{out.shape=} != {ref.shape=}")
  diff = out - ref
  num = jnp.max(jnp.abs(diff), initial=0.0)
  den = jnp.max(jnp.abs(ref), initial=0.0)
  err = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.where(num > 0, jnp.inf, 0.0))
  # A NaN anywhere gives NaN, as in max_rel_error: a max over a sharded array (its cross-device
  # reduction) can drop a NaN (seen with 8 CPU devices), an any() cannot.
  return jnp.where(jnp.any(jnp.isnan(diff)), jnp.nan, err)


def loopback_matmul_reduce_scatter(xs: jax.Array, ws: jax.Array, *,
                                   order: str = "source") -> jax.Array:
  """The unfused path emulated on one device, for the loopback comparisons.

  xs [D, m, k_shard], ws [D, k_shard, n] -> [D, m // D, n]. Each rank's f32-accumulated
  partial is rounded to the input dtype (what `psum_scatter` receives), then the partials are
  summed with a rounding after every add, as a reduce-scatter over bf16 buffers does: in
  source order 0, 1, ..., D-1 (`order="source"`), or as NCCL's ring reduce-scatter on the
  identity ring, where chunk c adds sources c+1, c+2, ..., c (`order="ring"`; the same at
  D = 2). `lax.reduce_precision` keeps XLA from eliding those roundings (GPU XLA allows excess
  precision by default, which would make this baseline more accurate than the real unfused
  path).
  """
  if order not in ("source", "ring"):
    raise ValueError(f"{order=} must be 'source' or 'ring'")
  d, m, _ = xs.shape
  dtype = xs.dtype
  info = jnp.finfo(dtype)
  rnd = lambda v: lax.reduce_precision(v, exponent_bits=info.nexp, mantissa_bits=info.nmant)
  parts = jnp.einsum("dmk,dkn->dmn", xs, ws, preferred_element_type=jnp.float32)
  parts = rnd(parts).reshape(d, d, m // d, -1)  # [src, dst, m // D, n]
  if order == "source":
    acc = parts[0]
    for src in range(1, d):
      acc = rnd(acc + parts[src])
    return acc.astype(dtype)
  out = []
  for c in range(d):
    srcs = [(c + 1 + i) % d for i in range(d)]
    acc = parts[srcs[0], c]
    for src in srcs[1:]:
      acc = rnd(acc + parts[src, c])
    out.append(acc)
  return jnp.stack(out).astype(dtype)
