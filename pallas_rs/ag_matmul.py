"""All-gather matmul: `all_gather(lhs) @ rhs`, the mirror of matmul + reduce-scatter.

Used by the column-parallel layers of a sequence-parallel block (QKV, gate/up:
gather the token chunks, multiply by this device's weight columns) and by the
backward pass of the row-parallel op (`vjp.py`: gather the cotangent, multiply
by `w.T`). Two implementations:

  "xla"    `lax.all_gather(lhs, tiled=True)` then `jnp.dot` (fp32 accumulation).
  "fused"  jax's Mosaic GPU kernel
           `jax.experimental.pallas.ops.gpu.collective_matmul_mgpu.
           all_gather_lhs_matmul`: a ring that forwards LHS tiles to the
           previous device (`plgpu.remote_ref` + one semaphore; no NVLink
           multicast) while computing. Hopper, one process, bf16/f16, the
           gathered axis spanning every device of the process, gather along
           rows, shapes divisible by its tiles.

"auto" takes the kernel where `check_supported` passes and XLA otherwise; the
reason is logged once (shared log with `pallas_rs.api`).

The kernel does not return the gathered LHS (its receive buffer is internal),
so the "fused" path's second output is a separate `lax.all_gather`; callers
that need it (the row-parallel backward's dw) pay that all-gather again. XLA
drops it when unused (the column-parallel forward).
"""
from __future__ import annotations

import inspect
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from pallas_rs import api

IMPLEMENTATIONS = ("auto", "fused", "xla")
_KERNEL_DTYPES = ("bfloat16", "float16")


def default_config(m_shard: int, n: int) -> Any:
  """The kernel's `TuningConfig` for [m_shard, k] x [k, n] (not tuned yet).

  Two warpgroups side by side along N (CTA tile tile_m x 2*tile_n); tile_m 64
  when m_shard is not a multiple of 128 (M = 512 at D = 8). 3 pipeline stages:
  3 * (128 + 256) * 64 * 2 B = 144 KiB of operands + 32 KiB epilogue, well under
  the 227 KiB of SMEM (4 stages would be 224 KiB, too close to the limit).
  TODO(lead): tune on H200 with experiments/model_bench.py.
  """
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu  # pylint: disable=g-import-not-at-top
  tile_m = 128 if m_shard % 128 == 0 else 64
  tile_n = 128 if n % 256 == 0 else 64
  return hopper_matmul_mgpu.TuningConfig(
      tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=3,
      epi_tile_m=64, epi_tile_n=64,
      grid_minor_dim=hopper_matmul_mgpu.MatmulDimension.N,
      grid_tile_width=1,
      wg_dimension=hopper_matmul_mgpu.MatmulDimension.N)


def check_supported(*, m_shard: int, k: int, n: int, dtype, out_dtype,
                    num_devices: int, gather_dimension: int = 0,
                    config: Any = None) -> Any:
  """Returns the kernel config to use, or raises NotImplementedError (why).

  Args:
    m_shard: rows of this device's lhs (gathered to m_shard * num_devices).
    k: contraction size (lhs.shape[1] == rhs.shape[0]).
    n: columns of rhs (this device's output columns).
    dtype: dtype of lhs and rhs.
    out_dtype: dtype of the product.
    num_devices: size of the gathered mesh axis.
    gather_dimension: dimension of lhs to gather (the kernel: 0 only).
    config: a `hopper_matmul_mgpu.TuningConfig` or None (`default_config`).
  """
  if gather_dimension != 0:
    raise NotImplementedError(
        f"all_gather_lhs_matmul gathers rows only, got {gather_dimension=}")
  if not api._on_hopper():  # pylint: disable=protected-access
    dev = jax.devices()[0]
    raise NotImplementedError(
        "all_gather_lhs_matmul needs one process driving Hopper GPUs; have "
        f"platform={dev.platform!r} {dev.device_kind!r} "
        f"process_count={jax.process_count()}")
  if num_devices < 2:
    raise NotImplementedError(
        f"all_gather_lhs_matmul needs >= 2 devices, got {num_devices=}")
  if num_devices != jax.device_count():
    # The kernel raises ValueError for this; it is a legal call we do not run.
    raise NotImplementedError(
        "all_gather_lhs_matmul works only over all devices of the process "
        f"(axis size {num_devices=} != jax.device_count()="
        f"{jax.device_count()})")
  dtype_name, out_name = jnp.dtype(dtype).name, jnp.dtype(out_dtype).name
  if dtype_name not in _KERNEL_DTYPES or out_name != dtype_name:
    raise NotImplementedError(
        f"all_gather_lhs_matmul supports bf16/f16 in and the same dtype out, "
        f"got {dtype_name=} {out_name=}")
  try:
    from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu  # pylint: disable=g-import-not-at-top
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu  # pylint: disable=g-import-not-at-top
    params = inspect.signature(
        collective_matmul_mgpu.all_gather_lhs_matmul).parameters
    if not {"config", "dtype"} <= set(params):
      raise TypeError(f"all_gather_lhs_matmul{tuple(params)} lacks config= "
                      "or dtype=")
    config = default_config(m_shard, n) if config is None else config
  except (ImportError, TypeError, AttributeError) as e:
    raise NotImplementedError(
        f"jax's collective_matmul_mgpu is unavailable here: {e!r}") from None
  if config.cluster_dimension is not None:
    raise NotImplementedError("all_gather_lhs_matmul needs cluster_dimension "
                              f"None, got {config.cluster_dimension=}")
  wg_m = config.wg_dimension == hopper_matmul_mgpu.MatmulDimension.M
  cta_tile_m = config.tile_m * (2 if wg_m else 1)
  cta_tile_n = config.tile_n * (1 if wg_m else 2)
  for name, size, tile in (("m_shard", m_shard, cta_tile_m),
                           ("n", n, cta_tile_n), ("k", k, config.tile_k)):
    if size % tile:
      raise NotImplementedError(
          f"all_gather_lhs_matmul needs {name}={size} divisible by {tile} "
          f"({config=})")
  return config


def choose_implementation(*, m_shard: int, k: int, n: int, dtype, out_dtype,
                          num_devices: int, gather_dimension: int,
                          implementation: str, config: Any = None
                          ) -> tuple[str, Any, str | None]:
  """("fused" | "xla", kernel config, fallback reason or None).

  "fused" raises NotImplementedError where the kernel does not apply; "auto"
  falls back to "xla" with the reason.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
  if implementation == "xla":
    return "xla", None, None
  kwargs = dict(m_shard=m_shard, k=k, n=n, dtype=dtype, out_dtype=out_dtype,
                num_devices=num_devices, gather_dimension=gather_dimension,
                config=config)
  try:
    return "fused", check_supported(**kwargs), None
  except NotImplementedError as e:
    if implementation == "fused":
      raise
    return "xla", None, f"all_gather_matmul: {e}"


def all_gather_matmul(lhs: jax.Array, rhs: jax.Array, axis_name, *,
                      gather_dimension: int = 0, out_dtype=None,
                      implementation: str = "auto", config: Any = None
                      ) -> tuple[jax.Array, jax.Array]:
  """`all_gather(lhs) @ rhs` with fp32 accumulation; call inside shard_map.

  Same signature and results as `pallas_rs.vjp.all_gather_matmul`, plus the
  implementation choice. Not differentiable on the "fused" path (a Pallas
  call): differentiate through `model.column_parallel_matmul`, or the
  row-parallel op's custom VJP, which use this in their rules.

  Args:
    lhs: [m // D, k] (gather_dimension=0) or [m, k // D] (gather_dimension=1).
    rhs: [k, n], this device's weight columns.
    axis_name: the mesh axis to gather over (D = its size).
    gather_dimension: the dimension of `lhs` to gather.
    out_dtype: dtype of the product; defaults to `lhs.dtype`.
    implementation: "auto" | "fused" | "xla" (module docstring).
    config: `hopper_matmul_mgpu.TuningConfig` for the kernel, or None.

  Returns:
    (product [m, n], gathered lhs [m, k]).

  Raises:
    ValueError: bad ranks or shapes, unknown implementation.
    NotImplementedError: implementation="fused" where the kernel does not apply.
  """
  from pallas_rs import vjp  # pylint: disable=g-import-not-at-top
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  if lhs.ndim != 2 or rhs.ndim != 2:
    raise ValueError(f"lhs and rhs must be rank 2, got {lhs.shape=} "
                     f"{rhs.shape=}")
  num_devices = lax.axis_size(axis_name)
  k = lhs.shape[1] * (num_devices if gather_dimension == 1 else 1)
  if k != rhs.shape[0]:
    raise ValueError(f"contraction sizes differ: {lhs.shape=} "
                     f"{gather_dimension=} {rhs.shape=} ({num_devices=})")
  impl, config, reason = choose_implementation(
      m_shard=lhs.shape[0], k=k, n=rhs.shape[1], dtype=lhs.dtype,
      out_dtype=out_dtype, num_devices=num_devices,
      gather_dimension=gather_dimension, implementation=implementation,
      config=config)
  if reason is not None:
    api._log_fallback_once(reason)  # pylint: disable=protected-access
  if impl == "xla":
    return vjp.all_gather_matmul(lhs, rhs, axis_name,
                                 gather_dimension=gather_dimension,
                                 out_dtype=out_dtype)
  return _fused(lhs, rhs, axis_name, config, out_dtype)


def _fused(lhs, rhs, axis_name, config, out_dtype):
  from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu  # pylint: disable=g-import-not-at-top
  out = collective_matmul_mgpu.all_gather_lhs_matmul(
      lhs, rhs, axis_name, config=config, dtype=out_dtype)
  # Only materialised when the caller uses it (see the module docstring).
  return out, lax.all_gather(lhs, axis_name, axis=0, tiled=True)

