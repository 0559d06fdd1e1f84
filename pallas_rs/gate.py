"""The "auto" gate: fused kernel or XLA, decided once per call (docs/design.md section 6).

`choose_implementation` resolves `implementation=` of the row-parallel op (matmul +
reduce-scatter) and `choose_ag_implementation` that of the all-gather matmul. For "auto"
each checks, in order: the platform (one process driving Hopper GPUs, `pallas_rs.platform`),
the kernel's own rules (`fused.check_supported` / `ag_matmul.check_supported`, once), then the
tuning table (`tuning.select`): fused only where a measurement on this GPU kind at this D says it
wins. An explicit config skips the table (the caller asked for it). The resolved config is
handed down to the kernel (`fused.CheckedConfig`), which does not check it again.

`choose` is the shape-level part of the row-parallel decision (no platform or mesh), for
tools and tests: what "auto" would pick for a shape on a given GPU kind.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple

import jax

from pallas_rs import ag_matmul
from pallas_rs import platform
from pallas_rs import tuning

# The `implementation=` values of the ops (the one definition; experiments import it): "auto", or
# one of the choices a tuning-table entry makes.
IMPLEMENTATIONS = ("auto", *tuning.CHOICES)


class Resolved(NamedTuple):
  """What runs: implementation "fused" | "xla", its config, and why "auto" fell back (or None)."""
  implementation: str
  config: Any
  reason: str | None


def check_implementation(implementation) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")


def _fits(cfg, key: tuning.Key) -> str | None:
  """None if the matmul_rs `cfg` can run the shape of `key`, else why not: the kernel's own
  check (`fused.check_supported`: tiling, SMEM, this GPU's SM count, this jax), the same for a
  table's config as for a caller's."""
  if cfg is None:
    return "no config"
  from pallas_rs import fused  # pylint: disable=g-import-not-at-top  (Mosaic GPU import chain)
  try:
    fused.check_supported(m=key.m, k_shard=key.k_shard, n=key.n, dtype=key.dtype,
                          num_devices=key.num_devices, config=cfg)
  except (NotImplementedError, ValueError) as e:
    return str(e)
  return None


def _select(key: tuning.Key, default, table=None) -> tuning.Decision:
  return tuning.select(key, default=default, fits=functools.partial(_fits, key=key),
                       table=table)


def choose(*, m: int, n: int, k_shard: int, dtype, num_devices: int, gpu_kind: str,
           table: Mapping[str, Any] | None = None, config=None) -> tuning.Decision:
  """Fused vs XLA and the kernel config for one per-device row-parallel problem.

  Args:
    m: rows of the per-device x [m, k_shard] (global tokens); output [m // D, n].
    n: output columns.
    k_shard: per-device contraction size K / D.
    dtype: input dtype (name or numpy/jax dtype).
    num_devices: D.
    gpu_kind: `jax.Device.device_kind`, e.g. "NVIDIA H200".
    table: a table to consult instead of the active one (`pallas_rs.tuning`).
    config: an explicit kernel config from the caller: "fused" with it if it
      fits the shape (source "override"; the caller asked for that config),
      else "xla" saying why.

  Returns:
    A `tuning.Decision`. Never "fused" without a measurement (table or nearest
    measured m) or an explicit config. Shapes the kernel cannot take at all are
    "xla" (source "default", config None) with the kernel's reason.
  """
  from pallas_rs import fused  # pylint: disable=g-import-not-at-top  (Mosaic GPU import chain)
  key = tuning.make_key(m=m, n=n, k_shard=k_shard, dtype=dtype, num_devices=num_devices,
                        gpu_kind=gpu_kind)
  try:
    default = fused.check_supported(m=m, k_shard=k_shard, n=n, dtype=key.dtype,
                                    num_devices=num_devices)
  except (NotImplementedError, ValueError, TypeError) as e:
    return tuning.Decision("xla", None, "default", str(e))
  if config is not None:
    bad = _fits(config, key)
    if bad is None:
      return tuning.Decision("fused", config, "override", f"explicit config for {tuple(key)}")
    return tuning.Decision("xla", None, "override",
                           f"explicit config does not fit {tuple(key)}: {bad}")
  return _select(key, default, table)


def _tuned_config(*, m: int, k_shard: int, n: int, dtype, num_devices: int):
  """The config "fused" runs when the caller gives none: the table's tuned config for this
  shape on this GPU kind (the best fused config measured, whether or not it beat XLA), else the
  kernel's default. None where the kernel cannot take the shape (it then says why)."""
  from pallas_rs import fused  # pylint: disable=g-import-not-at-top  (Mosaic GPU import chain)
  try:
    default = fused.check_supported(m=m, k_shard=k_shard, n=n, dtype=dtype,
                                    num_devices=num_devices)
  except NotImplementedError:
    return None
  key = tuning.make_key(m=m, n=n, k_shard=k_shard, dtype=dtype, num_devices=num_devices,
                        gpu_kind=platform.device_kind())
  return _select(key, default).config


def choose_implementation(*, m: int, k_shard: int, n: int, dtype, num_devices: int,
                          scatter_dimension: int, implementation: str, config: Any,
                          axis_name=None) -> Resolved:
  """Resolves `implementation` of the row-parallel op, once per call.

  "xla" passes `config` through; "fused" too, or without one the table's tuned config for the
  shape (`_tuned_config`; the kernel checks it; on a non-Hopper GPU it raises
  NotImplementedError, and fails at run time saying so elsewhere). "auto":
  see the module doc; the config of a "fused" result has passed `fused.check_supported`.
  ValueError from the kernel's checks propagates; NotImplementedError means "fall back".
  """
  check_implementation(implementation)
  if implementation == "xla":
    return Resolved("xla", config, None)
  if implementation == "fused":
    if scatter_dimension != 0:
      raise NotImplementedError(
          f"the fused kernel supports only scatter_dimension=0, got "
          f"{scatter_dimension=}; use implementation='xla' or 'auto'")
    if jax.devices()[0].platform == "gpu" and not platform.on_hopper():
      raise NotImplementedError(
          platform.not_hopper_reason("implementation='fused' (the Mosaic GPU kernel)")
          + "; use implementation='auto' or 'xla'")
    if config is None and platform.on_hopper():
      config = _tuned_config(m=m, k_shard=k_shard, n=n, dtype=dtype, num_devices=num_devices)
    return Resolved("fused", config, None)
  if scatter_dimension != 0:
    return Resolved("xla", config,
                    f"fused kernel needs scatter_dimension=0, got {scatter_dimension=}")
  if not platform.on_hopper():
    return Resolved("xla", config, platform.not_hopper_reason("fused kernel"))
  from pallas_rs import fused  # pylint: disable=g-import-not-at-top
  try:
    fused.check_mesh(axis_name)
    checked = fused.check_supported(m=m, k_shard=k_shard, n=n, dtype=dtype,
                                    num_devices=num_devices, config=config)
  except NotImplementedError as e:
    return Resolved("xla", config, str(e))
  if config is not None:  # The caller asked for this config: the table's gate is skipped.
    return Resolved("fused", checked, None)
  key = tuning.make_key(m=m, n=n, k_shard=k_shard, dtype=dtype, num_devices=num_devices,
                        gpu_kind=platform.device_kind())
  decision = _select(key, checked)
  if decision.implementation == "fused":
    return Resolved("fused", decision.config, None)
  return Resolved("xla", None, f"tuning ({decision.source}): {decision.reason}")


def resolve(*, m: int, k_shard: int, n: int, dtype, num_devices: int, scatter_dimension: int,
            implementation: str, config: Any, axis_name=None) -> Resolved:
  """`choose_implementation`, with a checked config handed down as `fused.CheckedConfig`."""
  res = choose_implementation(m=m, k_shard=k_shard, n=n, dtype=dtype, num_devices=num_devices,
                              scatter_dimension=scatter_dimension,
                              implementation=implementation, config=config,
                              axis_name=axis_name)
  if implementation == "auto" and res.implementation == "fused":
    from pallas_rs import fused  # pylint: disable=g-import-not-at-top
    return res._replace(config=fused.CheckedConfig.of(
        res.config, m=m, k_shard=k_shard, n=n, dtype=dtype, num_devices=num_devices))
  return res


def choose_ag_implementation(*, m_shard: int, k: int, n: int, dtype, out_dtype,
                             num_devices: int, gather_dimension: int, implementation: str,
                             config: Any = None,
                             table: Mapping[str, Any] | None = None) -> Resolved:
  """Resolves `implementation` of the all-gather matmul `all_gather(lhs) @ rhs`.

  Args:
    m_shard: rows of this device's lhs (gathered to m_shard * num_devices).
    k: contraction size (lhs.shape[1] == rhs.shape[0]).
    n: columns of rhs.
    dtype, out_dtype: of the operands and of the product.
    num_devices: size of the gathered axis.
    gather_dimension: dimension of lhs to gather (the kernel: 0 only).
    implementation: "fused" raises NotImplementedError where the kernel does not apply;
      "auto" runs the kernel only where the tuning table (op "ag_matmul") measured it to win
      at this shape and D on this GPU kind, else XLA with the reason.
    config: a `hopper_matmul_mgpu.TuningConfig` (skips the table), or None.
    table: a table to consult instead of the active one.
  """
  check_implementation(implementation)
  if implementation == "xla":
    return Resolved("xla", None, None)
  kwargs = dict(m_shard=m_shard, k=k, n=n, dtype=dtype, out_dtype=out_dtype,
                num_devices=num_devices, gather_dimension=gather_dimension)
  try:
    checked = ag_matmul.check_supported(**kwargs, config=config)
  except NotImplementedError as e:
    if implementation == "fused":
      raise
    return Resolved("xla", None, f"all_gather_matmul: {e}")
  if implementation == "fused" or config is not None:
    return Resolved("fused", checked, None)

  def fits(cfg):
    try:
      ag_matmul.check_supported(**kwargs, config=cfg)
    except NotImplementedError as e:
      return str(e)
    return None

  key = tuning.make_key(m=m_shard * num_devices, n=n, k_shard=k, dtype=dtype,
                        num_devices=num_devices, gpu_kind=platform.device_kind())
  decision = tuning.select(key, op="ag_matmul", default=checked, fits=fits, table=table)
  if decision.implementation == "fused":
    return Resolved("fused", decision.config, None)
  return Resolved("xla", None,
                  f"all_gather_matmul: tuning ({decision.source}): {decision.reason}")

