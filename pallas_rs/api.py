"""Public entry points: validate, choose an implementation, apply the custom VJP."""
from __future__ import annotations

import functools
from typing import Any

from absl import logging
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_rs import vjp

IMPLEMENTATIONS = ("auto", "fused", "xla")

# Fallback reasons already logged, so that each distinct reason is logged once
# per process rather than once per trace.
_logged_fallback_reasons: set[str] = set()


def reset_fallback_log() -> None:
  """Forgets the logged fallback reasons (for tests)."""
  _logged_fallback_reasons.clear()


def _log_fallback_once(reason: str) -> None:
  if reason in _logged_fallback_reasons:
    return
  _logged_fallback_reasons.add(reason)
  # On a GPU the user may have expected the fused kernel: say so loudly.
  if jax.devices()[0].platform == "gpu":
    logging.warning("pallas_rs: using the XLA path: %s", reason)
  else:
    logging.info("pallas_rs: using the XLA path: %s", reason)


def _on_hopper() -> bool:
  """Whether the fused kernel can run here: one process driving Hopper GPUs."""
  dev = jax.devices()[0]
  return (dev.platform == "gpu"
          and str(getattr(dev, "compute_capability", "")).startswith("9.")
          and jax.process_count() == 1)


def _normalize_scatter_dimension(scatter_dimension) -> int:
  if scatter_dimension not in (0, 1, -2, -1) or isinstance(scatter_dimension,
                                                           bool):
    raise ValueError(
        f"{scatter_dimension=} must be 0 (rows) or 1 (columns); -2 and -1 are "
        "accepted as aliases")
  return scatter_dimension % 2


def _validate(x, w, axis_name, scatter_dimension, implementation):
  """Checks the per-device arguments; returns (num_devices, scatter_dimension)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
  scatter_dimension = _normalize_scatter_dimension(scatter_dimension)
  if x.ndim != 2 or w.ndim != 2:
    raise ValueError(f"x and w must be rank 2 ([m, k_shard] and [k_shard, n]), "
                     f"got {x.shape=} {w.shape=}")
  if x.dtype != w.dtype:
    raise ValueError(f"x and w must have the same dtype, got {x.dtype=} "
                     f"{w.dtype=}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x and w must be floating point, got {x.dtype=}")
  if x.shape[1] != w.shape[0]:
    raise ValueError(f"contraction dimensions differ: {x.shape=} {w.shape=} "
                     f"(x.shape[1] must equal w.shape[0])")
  try:
    num_devices = lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"unknown {axis_name=}: call matmul_reduce_scatter inside jax.shard_map "
        f"over a mesh with that axis ({e})") from None
  dim_name = ("m", "n")[scatter_dimension]
  size = (x.shape[0], w.shape[1])[scatter_dimension]
  if size % num_devices:
    raise ValueError(
        f"{dim_name}={size} must be divisible by the size of {axis_name=} "
        f"({num_devices=}) to scatter along {scatter_dimension=}; "
        f"{x.shape=} {w.shape=}")
  return num_devices, scatter_dimension


def _choose_implementation(*, m: int, k_shard: int, n: int, dtype,
                           num_devices: int, scatter_dimension: int,
                           implementation: str, config: Any, axis_name=None
                           ) -> tuple[str, Any, str | None]:
  """Resolves `implementation` to ("fused" | "xla", config, fallback reason).

  The reason is None unless "auto" fell back to XLA. ValueError from the fused
  kernel's checks propagates; NotImplementedError means "fall back". For
  "fused" the config is passed through unchanged (the kernel resolves None).

  "auto" on Hopper: the kernel must support the call (`fused.check_supported`);
  then an explicit `config` means "fused" with that config (the user asked for
  it), and without one `pallas_rs.tuning.choose` decides fused vs XLA and the
  config from the tuning table (fused only where measured to win).
  """
  if implementation == "xla":
    return "xla", config, None
  if implementation == "fused":
    if scatter_dimension != 0:
      raise NotImplementedError(
          f"the fused kernel supports only scatter_dimension=0, got "
          f"{scatter_dimension=}; use implementation='xla' or 'auto'")
    return "fused", config, None
  assert implementation == "auto", implementation
  if scatter_dimension != 0:
    return "xla", config, f"fused kernel needs scatter_dimension=0, got {scatter_dimension=}"
  if not _on_hopper():
    dev = jax.devices()[0]
    return "xla", config, (
        "fused kernel needs one process driving Hopper GPUs; have "
        f"platform={dev.platform!r} {dev.device_kind!r} "
        f"process_count={jax.process_count()}")
  from pallas_rs import fused  # pylint: disable=g-import-not-at-top
  from pallas_rs import tuning  # pylint: disable=g-import-not-at-top
  try:
    fused.check_mesh(axis_name)
    fused.check_supported(m=m, k_shard=k_shard, n=n, dtype=dtype,
                          num_devices=num_devices, config=config)
  except NotImplementedError as e:
    return "xla", config, str(e)
  # An explicit config overrides the table's gate (tuning's "override" source).
  decision = tuning.choose(m=m, n=n, k_shard=k_shard, dtype=dtype,
                           num_devices=num_devices,
                           gpu_kind=jax.devices()[0].device_kind, config=config)
  if decision.implementation == "fused":
    return "fused", decision.config, None
  return "xla", None, f"tuning ({decision.source}): {decision.reason}"


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, *, axis_name,
                          scatter_dimension: int = 0,
                          implementation: str = "auto",
                          config: Any = None) -> jax.Array:
  """Matmul + reduce-scatter of a row-parallel linear layer, inside shard_map.

  Each of the D devices along `axis_name` holds a slice of the contraction
  dimension; the result is the chunk of `sum over devices of x @ w` this device
  owns, accumulated in fp32 and returned in `x.dtype`. Differentiable (custom
  VJP: all-gather of the cotangent, then two matmuls).

  Args:
    x: [m, k_shard] (k_shard = K / D), this device's activations.
    w: [k_shard, n], this device's weight rows; same dtype as `x`.
    axis_name: mesh axis of the enclosing `jax.shard_map` that K is sharded over.
    scatter_dimension: 0 (default) scatters rows, giving [m // D, n]
      (sequence parallelism); 1 scatters columns, giving [m, n // D]. -2 and -1
      are accepted as aliases of 0 and 1.
    implementation: "xla" (`jnp.dot` + `lax.psum_scatter`), "fused" (the Mosaic
      GPU kernel; Hopper only) or "auto" (on Hopper, the fused kernel where the
      tuning table, `pallas_rs.tuning`, measured it to win, else XLA; the
      reason for falling back is logged once).
    config: optional `pallas_rs.Config` for the fused kernel. With "auto", an
      explicit config selects the fused kernel wherever it supports the call
      (the table's gate and config are skipped).

  Returns:
    [m // D, n] for scatter_dimension=0, [m, n // D] for 1; device d holds
    chunk d.

  Raises:
    ValueError: bad ranks, dtypes, shapes, axis name, scatter_dimension or
      implementation.
    NotImplementedError: implementation="fused" for a legal call the kernel
      does not support (e.g. scatter_dimension=1).
  """
  x, w = jnp.asarray(x), jnp.asarray(w)
  num_devices, scatter_dimension = _validate(x, w, axis_name, scatter_dimension,
                                             implementation)
  impl, config, reason = _choose_implementation(
      m=x.shape[0], k_shard=x.shape[1], n=w.shape[1], dtype=x.dtype,
      num_devices=num_devices, scatter_dimension=scatter_dimension,
      implementation=implementation, config=config, axis_name=axis_name)
  if reason is not None:
    _log_fallback_once(reason)
  return vjp.matmul_reduce_scatter(x, w, axis_name, scatter_dimension, impl,
                                   config)


def _constrain(a, mesh, spec):
  sharding = NamedSharding(mesh, spec)
  if any(name in mesh.explicit_axes for name in spec if name is not None):
    return jax.sharding.reshard(a, sharding)
  return lax.with_sharding_constraint(a, sharding)


@functools.lru_cache(maxsize=64)
def _row_parallel_fn(mesh, axis_name, scatter_dimension, kwargs):
  x_spec, w_spec = P(None, axis_name), P(axis_name, None)
  out_spec = P(axis_name, None) if scatter_dimension == 0 else P(None, axis_name)
  per_device = functools.partial(matmul_reduce_scatter, axis_name=axis_name,
                                 scatter_dimension=scatter_dimension,
                                 **dict(kwargs))
  mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(x_spec, w_spec),
                         out_specs=out_spec, check_vma=False)

  def fn(x, w):
    return mapped(_constrain(x, mesh, x_spec), _constrain(w, mesh, w_spec))

  return jax.jit(fn)


def row_parallel_matmul(x: jax.Array, w: jax.Array, *, mesh: jax.sharding.Mesh,
                        axis_name, scatter_dimension: int = 0,
                        **kwargs) -> jax.Array:
  """Global-array wrapper: `x @ w` with K sharded and the result scattered.

  Applies `jax.jit(jax.shard_map(matmul_reduce_scatter, ...))` with x sharded
  as P(None, axis_name), w as P(axis_name, None) and the output as
  P(axis_name, None) (P(None, axis_name) for scatter_dimension=1).

  Args:
    x: [m, k] global activations.
    w: [k, n] global weight.
    mesh: the device mesh; must contain `axis_name`.
    axis_name: the mesh axis to shard K over (D = its size).
    scatter_dimension: as in `matmul_reduce_scatter`.
    **kwargs: `implementation` and `config`, passed to `matmul_reduce_scatter`.

  Returns:
    [m, n], sharded along rows (or columns for scatter_dimension=1).

  Raises:
    ValueError: as `matmul_reduce_scatter`, and for an axis not in the mesh or
      k not divisible by D.
  """
  if axis_name not in mesh.axis_names:
    raise ValueError(f"{axis_name=} is not an axis of the mesh "
                     f"({mesh.axis_names=})")
  if jnp.ndim(x) != 2 or jnp.ndim(w) != 2:
    raise ValueError(f"x and w must be rank 2 ([m, k] and [k, n]), got "
                     f"{jnp.shape(x)=} {jnp.shape(w)=}")
  num_devices = mesh.shape[axis_name]
  k = jnp.shape(x)[1]
  if k != jnp.shape(w)[0]:
    raise ValueError(f"contraction dimensions differ: {jnp.shape(x)=} "
                     f"{jnp.shape(w)=}")
  if k % num_devices:
    raise ValueError(f"{k=} must be divisible by the size of {axis_name=} "
                     f"({num_devices=})")
  scatter_dimension = _normalize_scatter_dimension(scatter_dimension)
  fn = _row_parallel_fn(mesh, axis_name, scatter_dimension,
                        tuple(sorted(kwargs.items())))
  return fn(x, w)
