"""jax's fused all-gather matmul kernel, as pallas_rs uses it.

`all_gather(lhs) @ rhs` is the mirror of matmul + reduce-scatter: the column-parallel layers
of a sequence-parallel block (QKV, gate/up) and the backward pass of the row-parallel op
(gather the cotangent, multiply by `w.T`). Its XLA path is `pallas_rs.reference.all_gather_matmul`;
this module is the fused one: jax's Mosaic GPU kernel
`jax.experimental.pallas.ops.gpu.collective_matmul_mgpu.all_gather_lhs_matmul`, a ring that
forwards LHS tiles to the previous device (`plgpu.remote_ref` + one semaphore; no NVLink
multicast) while computing. Hopper, one process, bf16/f16, the gathered axis spanning every
device of the process, gather along rows, shapes divisible by its tiles (`check_supported`).
Which path runs is `pallas_rs.tuning.gate.decide`'s call (docs/design.md section 6).

The kernel does not return the gathered LHS (its receive buffer is internal), so
`fused_all_gather_matmul`'s second output is a separate `lax.all_gather`; callers that need it
(the row-parallel backward's dw) pay that all-gather again. XLA drops it when unused.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping

import jax
from jax import lax
import jax.numpy as jnp

from pallas_rs import platform

_KERNEL_DTYPES = ("bfloat16", "float16")


def default_config(m_shard: int, n: int) -> Any:
  """The kernel's `TuningConfig` for [m_shard, k] x [k, n] (not tuned yet).

  Two warpgroups side by side along N (CTA tile tile_m x 2*tile_n); tile_m 64
  when m_shard is not a multiple of 128 (M = 512 at D = 8). 3 pipeline stages:
  3 * (128 + 256) * 64 * 2 B = 144 KiB of operands + 32 KiB epilogue, well under
  the 227 KiB of SMEM (4 stages would be 224 KiB, too close to the limit).
  `experiments/autotune.py --op=ag_matmul` measures it against XLA per shape and D.
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
  if not platform.on_hopper():
    raise NotImplementedError(platform.not_hopper_reason("all_gather_lhs_matmul"))
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
  bad = tiling_problem(config, m_shard=m_shard, k=k, n=n)
  if bad:
    raise NotImplementedError(f"all_gather_lhs_matmul needs {bad} ({config=})")
  return config


def tiling_problem(config, *, m_shard: int, k: int, n: int) -> str | None:
  """Why `config`'s tiles cannot cover [m_shard, k] x [k, n] (None if they can): the CTA tile
  (two warpgroup tiles side by side along `wg_dimension`) must divide the shard's rows and
  columns, and with the N split the second warpgroup's w columns must start on a 64-column
  swizzle tile."""
  from pallas_rs.kernel import config as config_lib  # pylint: disable=g-import-not-at-top
  if not config_lib.wg_split_aligned(config.tile_n, config.wg_dimension):
    return f"tile_n={config.tile_n} a multiple of 64 with the warpgroups along N"
  cta_tile_m, cta_tile_n = config_lib.cta_tile(config.tile_m, config.tile_n,
                                               config.wg_dimension)
  for name, size, tile in (("m_shard", m_shard, cta_tile_m),
                           ("n", n, cta_tile_n), ("k", k, config.tile_k)):
    if size % tile:
      return f"{name}={size} divisible by {tile}"
  return None


def fused_all_gather_matmul(lhs, rhs, axis_name, *, config, out_dtype
                            ) -> tuple[jax.Array, jax.Array]:
  """The kernel inside shard_map: (all_gather(lhs) @ rhs [m, n], gathered lhs [m, k]).

  `config` must come from `check_supported` for this call. Not differentiable (a Pallas call):
  the custom VJPs of pallas_rs use it inside their rules.
  """
  from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu  # pylint: disable=g-import-not-at-top
  out = collective_matmul_mgpu.all_gather_lhs_matmul(
      lhs, rhs, axis_name, config=config, dtype=out_dtype)
  # Only materialised when the caller uses it (see the module docstring).
  return out, lax.all_gather(lhs, axis_name, axis=0, tiled=True)


def config_to_json(cfg) -> dict[str, Any]:
  """A `hopper_matmul_mgpu.TuningConfig` as a tuning-table object (enums by name)."""
  out = {}
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    out[f.name] = getattr(value, "name", value)
  return out


def config_from_json(obj: Mapping[str, Any]):
  """Inverse of `config_to_json`; ValueError on unknown fields or bad values."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu  # pylint: disable=g-import-not-at-top
  if not isinstance(obj, Mapping):
    raise ValueError(f"config must be an object, got {type(obj).__name__}")
  fields = {f.name for f in dataclasses.fields(hopper_matmul_mgpu.TuningConfig)}
  unknown = sorted(set(obj) - fields)
  if unknown:
    raise ValueError(f"unknown all-gather matmul config fields {unknown}; known: {sorted(fields)}")
  kw = dict(obj)
  for name in ("grid_minor_dim", "wg_dimension", "cluster_dimension"):
    if kw.get(name) is not None:
      try:
        kw[name] = hopper_matmul_mgpu.MatmulDimension[kw[name]]
      except KeyError:
        raise ValueError(f"{name}={kw[name]!r} must be 'M' or 'N'") from None
  for name, value in kw.items():
    if name not in ("grid_minor_dim", "wg_dimension", "cluster_dimension", "epi_tile_m",
                    "epi_tile_n") and (not isinstance(value, int) or isinstance(value, bool)):
      raise ValueError(f"config field {name}={value!r} must be an int")
  try:
    return hopper_matmul_mgpu.TuningConfig(**kw)
  except TypeError as e:
    raise ValueError(f"all-gather matmul config: {e}") from None
