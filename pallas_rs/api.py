"""Public entry points: validate, resolve the implementation once, apply the custom VJP.

  matmul_reduce_scatter   inside `jax.shard_map`: row-parallel matmul + reduce-scatter.
  row_parallel_matmul     the same on global arrays (applies jit + shard_map).
  all_gather_matmul       inside `jax.shard_map`: its mirror, `all_gather(lhs) @ rhs`.

Each validates its arguments once, `pallas_rs.tuning.gate.decide` then decides the implementation
and checks its config once per trace (docs/design.md section 6), and the chosen path runs.
"""
from __future__ import annotations

from collections.abc import Hashable
import functools
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from pallas_rs import platform
from pallas_rs import tuning
from pallas_rs import vjp
from pallas_rs.tuning import gate

# The `implementation=` values of the ops (the one definition; model.py and the experiments
# import it): "auto", or one of the choices a tuning-table entry makes.
IMPLEMENTATIONS = ("auto", *tuning.CHOICES)


def check_implementation(implementation) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")


def _normalize_scatter_dimension(scatter_dimension, name="scatter_dimension") -> int:
  """0 or 1 (-2, -1 their aliases; an integer, not a bool or a float: 1.0 is refused)."""
  if (isinstance(scatter_dimension, bool) or not isinstance(scatter_dimension, (int, np.integer))
      or scatter_dimension not in (0, 1, -2, -1)):
    raise ValueError(
        f"{name}={scatter_dimension!r} must be 0 (rows) or 1 (columns); -2 and -1 are "
        "accepted as aliases")
  return int(scatter_dimension) % 2


def _check_config(config) -> None:
  """`config` must be None or a `pallas_rs.Config` (a dict or a string is a mistake)."""
  if config is None:
    return
  from pallas_rs.kernel.config import Config  # pylint: disable=g-import-not-at-top  (Mosaic GPU imports)
  if not isinstance(config, Config):
    raise TypeError(f"config must be a pallas_rs.Config or None, got {type(config).__name__} "
                    f"{config!r}; e.g. config=pallas_rs.Config(tile_m=64)")


def _check_ag_config(config) -> None:
  """all_gather_matmul's `config` must be None or jax's `hopper_matmul_mgpu.TuningConfig`."""
  if config is None:
    return
  try:
    from jax.experimental.pallas.ops.gpu import (  # pylint: disable=g-import-not-at-top
        hopper_matmul_mgpu)
  except ImportError:  # No kernel here: "fused" raises NotImplementedError, saying so.
    return
  if not isinstance(config, hopper_matmul_mgpu.TuningConfig):
    raise TypeError(f"config of all_gather_matmul must be a jax hopper_matmul_mgpu.TuningConfig "
                    f"or None, got {type(config).__name__} {config!r}")


def _check_floating(dtype, what: str) -> None:
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{what} must be floating point, got {dtype=}")
  if jnp.dtype(dtype) == jnp.float64:
    # The products accumulate in float32 (docs/design.md section 5): a float64 result would
    # silently carry float32 accuracy.
    raise ValueError(f"{what}: float64 is not supported (accumulation is float32); cast the "
                     f"inputs to float32 or bfloat16, got {dtype=}")


def _check_operands(a, b, names=("x", "w"), dims=("m", "k_shard", "n")) -> None:
  """Arrays (not lists), rank 2, no dimension of size 0: else a ValueError naming the argument
  and the shapes (before jax, XLA or the kernel fail in their own terms).

  Args:
    a, b: the operands ([rows, contraction] and [contraction, columns]).
    names: their argument names.
    dims: the names of a's rows, the contraction and b's columns.
  """
  for name, arg in zip(names, (a, b)):
    if not isinstance(arg, (jax.Array, np.ndarray)):
      raise ValueError(f"{name} must be a jax.Array or numpy array, got {type(arg).__name__}; "
                       f"convert it first, e.g. jnp.asarray({name}, jnp.bfloat16)")
  (a_name, b_name), shapes = names, f"{names[0]}.shape={a.shape} {names[1]}.shape={b.shape}"
  if a.ndim != 2 or b.ndim != 2:
    raise ValueError(f"{a_name} and {b_name} must be rank 2 ([{dims[0]}, {dims[1]}] and "
                     f"[{dims[1]}, {dims[2]}]), got {shapes}")
  sizes = (a.shape[0], min(a.shape[1], b.shape[0]), b.shape[1])
  empty = [f"{d}=0" for d, size in zip(dims, sizes) if size == 0]
  if empty:
    raise ValueError(f"zero-size operands are not supported ({', '.join(empty)}): got {shapes}")


def _axis_names(axis_name, fn_name: str) -> tuple:
  """`axis_name` as a tuple of mesh axis names (one checked spelling for both layers)."""
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not names or not all(isinstance(n, Hashable) for n in names):
    raise ValueError(f"{axis_name=} of {fn_name} must be a mesh axis name or a non-empty tuple "
                     "of distinct ones")
  if len(set(names)) != len(names):
    raise ValueError(f"{axis_name=} of {fn_name} names a mesh axis more than once")
  return names


def _axis_size(axis_name, fn_name: str) -> int:
  _axis_names(axis_name, fn_name)
  try:
    return lax.axis_size(axis_name)
  except (NameError, ValueError) as e:
    raise ValueError(
        f"unknown {axis_name=}: call {fn_name} inside jax.shard_map "
        f"over a mesh with that axis ({e})") from None


def _validate(x, w, axis_name, scatter_dimension, implementation, config):
  """Checks the per-device arguments; returns (num_devices, scatter_dimension)."""
  check_implementation(implementation)
  _check_config(config)
  scatter_dimension = _normalize_scatter_dimension(scatter_dimension)
  _check_operands(x, w)
  if x.dtype != w.dtype:
    raise ValueError(f"x and w must have the same dtype, got {x.dtype=} "
                     f"{w.dtype=}")
  _check_floating(x.dtype, "x and w")
  if x.shape[1] != w.shape[0]:
    raise ValueError(f"contraction dimensions differ: {x.shape=} {w.shape=} "
                     f"(x.shape[1] must equal w.shape[0])")
  num_devices = _axis_size(axis_name, "matmul_reduce_scatter")
  _check_scatter_divisible(x, w, axis_name, num_devices, scatter_dimension)
  return num_devices, scatter_dimension


def _check_scatter_divisible(x, w, axis_name, num_devices, scatter_dimension) -> None:
  dim_name = ("m", "n")[scatter_dimension]
  size = (x.shape[0], w.shape[1])[scatter_dimension]
  if size % num_devices:
    raise ValueError(
        f"{dim_name}={size} must be divisible by the size of {axis_name=} "
        f"({num_devices=}) to scatter along {scatter_dimension=}; "
        f"{x.shape=} {w.shape=}")


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
      The mesh may have other axes (e.g. data parallelism): the sum then runs
      within each group of devices that share their coordinates on those axes.
    scatter_dimension: 0 (default) scatters rows, giving [m // D, n]
      (sequence parallelism); 1 scatters columns, giving [m, n // D]. -2 and -1
      are accepted as aliases of 0 and 1.
    implementation: "xla" (`jnp.dot` + `lax.psum_scatter`), "fused" (the Mosaic
      GPU kernel; Hopper only: elsewhere it raises, saying so) or "auto" (on
      Hopper, the fused kernel where the tuning table, `pallas_rs.tuning`,
      measured it to win, else XLA; the reason for falling back is logged once).
    config: optional `pallas_rs.Config` for the fused kernel (anything else is a
      TypeError). With "auto", an explicit config selects the fused kernel
      wherever it supports the call (the table's gate and config are skipped).

  Returns:
    [m // D, n] for scatter_dimension=0, [m, n // D] for 1; device d holds
    chunk d.

  Raises:
    ValueError: bad ranks, dtypes (float64 included: accumulation is float32),
      shapes, axis name, scatter_dimension or implementation.
    TypeError: a config that is not a `pallas_rs.Config`.
    NotImplementedError: implementation="fused" for a legal call the kernel
      does not support (e.g. scatter_dimension=1, or a GPU that is not Hopper).
  """
  num_devices, scatter_dimension = _validate(x, w, axis_name, scatter_dimension,
                                             implementation, config)
  decision = gate.decide(
      "matmul_rs", m=x.shape[0], k_shard=x.shape[1], n=w.shape[1], dtype=x.dtype,
      num_devices=num_devices, implementation=implementation, config=config,
      dimension=scatter_dimension, axis_name=axis_name)
  if decision.fallback is not None:
    platform.log_fallback_once(decision.fallback)
  x, w = vjp.match_vma(jnp.asarray(x), jnp.asarray(w))
  return vjp.matmul_reduce_scatter(x, w, axis_name, scatter_dimension,
                                   decision.implementation, decision.config)


def all_gather_matmul(lhs: jax.Array, rhs: jax.Array, axis_name, *,
                      gather_dimension: int = 0, out_dtype=None,
                      implementation: str = "auto", config: Any = None
                      ) -> tuple[jax.Array, jax.Array]:
  """`all_gather(lhs) @ rhs` with fp32 accumulation; call inside shard_map.

  The mirror of `matmul_reduce_scatter` (column-parallel layers of a sequence-parallel
  block). Not differentiable on the "fused" path (a Pallas call): differentiate through
  `model.column_parallel_matmul`, or the row-parallel op's custom VJP, which use this in
  their rules.

  Args:
    lhs: [m // D, k] (gather_dimension=0) or [m, k // D] (gather_dimension=1).
    rhs: [k, n], this device's weight columns.
    axis_name: the mesh axis to gather over (D = its size).
    gather_dimension: the dimension of `lhs` to gather.
    out_dtype: dtype of the product; defaults to `lhs.dtype`.
    implementation: "xla" (`pallas_rs.reference.all_gather_matmul`), "fused" (jax's
      collective_matmul_mgpu, `pallas_rs.kernel.ag_matmul`) or "auto" (the kernel only where the
      tuning table measured it to win, `gate.decide`; else XLA, the reason
      logged once).
    config: `hopper_matmul_mgpu.TuningConfig` for the kernel, or None (anything else is a
      TypeError).

  Returns:
    (product [m, n], gathered lhs [m, k]).

  Raises:
    ValueError: bad ranks, shapes or dtypes (lhs and rhs alike, out_dtype floating, none
      float64), gather_dimension, unknown implementation or axis.
    TypeError: a config that is not a `TuningConfig`.
    NotImplementedError: implementation="fused" where the kernel does not apply.
  """
  check_implementation(implementation)
  _check_ag_config(config)
  gather_dimension = _normalize_scatter_dimension(gather_dimension, "gather_dimension")
  _check_operands(lhs, rhs, ("lhs", "rhs"), ("m_shard", "k", "n"))
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"lhs and rhs must have the same dtype, got {lhs.dtype=} {rhs.dtype=}")
  _check_floating(lhs.dtype, "lhs and rhs")
  try:
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  except TypeError:
    raise ValueError(f"{out_dtype=} is not a dtype; e.g. out_dtype=jnp.float32") from None
  _check_floating(out_dtype, "out_dtype")
  num_devices = _axis_size(axis_name, "all_gather_matmul")
  k = lhs.shape[1] * (num_devices if gather_dimension == 1 else 1)
  if k != rhs.shape[0]:
    raise ValueError(f"contraction sizes differ: {lhs.shape=} "
                     f"{gather_dimension=} {rhs.shape=} ({num_devices=})")
  decision = gate.decide(
      "ag_matmul", m=lhs.shape[0] * num_devices, k_shard=k, n=rhs.shape[1], dtype=lhs.dtype,
      out_dtype=out_dtype, num_devices=num_devices, implementation=implementation,
      config=config, dimension=gather_dimension)
  return vjp.run_all_gather_matmul(lhs, rhs, axis_name, gather_dimension=gather_dimension,
                                   out_dtype=out_dtype, decision=decision)


def _constrain(a, mesh, spec):
  sharding = NamedSharding(mesh, spec)
  names = [n for entry in spec if entry is not None
           for n in (entry if isinstance(entry, tuple) else (entry,))]
  if any(name in mesh.explicit_axes for name in names):
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


def _check_placed_on(mesh, x, w) -> None:
  """An AbstractMesh names no devices: outside `jax.set_mesh` the (concrete) inputs must already
  lie on a mesh of its size, else XLA fails at run time with an internal error."""
  if not isinstance(mesh, jax.sharding.AbstractMesh) or platform.traced_mesh(mesh) is not None:
    return
  for name, a in (("x", x), ("w", w)):
    if isinstance(a, jax.core.Tracer):
      continue
    on = len(a.sharding.device_set) if isinstance(a, jax.Array) else 1
    if on != mesh.size:
      raise ValueError(f"mesh is an AbstractMesh of {mesh.size} devices but {name} lies on {on}; "
                       "pass the concrete jax.sharding.Mesh, or call inside jax.set_mesh(mesh)")


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
    axis_name: the mesh axis to shard K over (D = its size), or a tuple of mesh
      axes (D = the product of their sizes).
    scatter_dimension: as in `matmul_reduce_scatter`.
    **kwargs: `implementation` and `config`, passed to `matmul_reduce_scatter`
      (validated here, before the jit cache sees them).

  Returns:
    [m, n], sharded along rows (or columns for scatter_dimension=1).

  Raises:
    ValueError: as `matmul_reduce_scatter`, and for an axis not in the mesh or
      k not divisible by D.
  """
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, e.g. jax.make_mesh((D,), "
                     f"({axis_name!r},)), got {mesh=}")
  names = _axis_names(axis_name, "row_parallel_matmul")
  if any(name not in mesh.axis_names for name in names):
    raise ValueError(f"{axis_name=} is not an axis of the mesh "
                     f"({mesh.axis_names=}; a tuple of its axes is also accepted)")
  _check_operands(x, w, dims=("m", "k", "n"))
  _check_placed_on(mesh, x, w)
  num_devices = math.prod(mesh.shape[name] for name in names)
  k = x.shape[1]
  if k != w.shape[0]:
    raise ValueError(f"contraction dimensions differ: {x.shape=} {w.shape=}")
  if k % num_devices:
    raise ValueError(f"{k=} must be divisible by the size of {axis_name=} "
                     f"({num_devices=})")
  scatter_dimension = _normalize_scatter_dimension(scatter_dimension)
  _check_scatter_divisible(x, w, axis_name, num_devices, scatter_dimension)  # global shapes
  unknown = sorted(set(kwargs) - {"implementation", "config"})
  if unknown:
    raise TypeError(f"unexpected keyword arguments {unknown}; row_parallel_matmul takes "
                    "implementation= and config=")
  check_implementation(kwargs.get("implementation", "auto"))
  _check_config(kwargs.get("config"))
  fn = _row_parallel_fn(mesh, axis_name, scatter_dimension,
                        tuple(sorted(kwargs.items())))
  with platform.tracing_on_mesh(mesh):  # the gate sees the mesh's device order
    return fn(x, w)
