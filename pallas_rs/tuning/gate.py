"""The gate: which implementation runs one call, with which checked config, and why
(docs/design.md section 6).

`decide` is the one entry point, for both ops: "matmul_rs" (this package's matmul +
reduce-scatter) and "ag_matmul" (jax's all-gather matmul, its mirror). The api has validated the
arguments; `decide` runs the kernel's own check (`fused.check_supported` /
`ag_matmul.check_supported`) once on whichever config will run, the caller's or the tuning
table's, and hands that config down checked: the row-parallel kernel's entry points take a
`fused.CheckedConfig` without checking again.

For "auto", in order: the platform (one process driving Hopper GPUs, `pallas_rs.platform`),
the kernel's rules on this mesh and shape, an explicit config (the caller asked for it: the
table is skipped), then the tuning table (`tuning.select`): fused only where a measurement on
this GPU kind at this D says it wins.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax

from pallas_rs import platform
from pallas_rs import tuning
from pallas_rs.kernel import ag_matmul

OPS = tuning.OPS  # "matmul_rs", "ag_matmul"


class Decision(NamedTuple):
  """What runs one call.

  Attributes:
    implementation: "fused" or "xla".
    config: for "fused", the checked kernel config ("matmul_rs": a `fused.CheckedConfig`;
      "ag_matmul": a `hopper_matmul_mgpu.TuningConfig` that `ag_matmul.check_supported`
      returned); None for "xla".
    reason: why, where "auto" decided ("tuning (table): ...", "tuning (heuristic): ...",
      "tuning (default): ...", "explicit config ...", or the kernel's or the platform's
      NotImplementedError); None where the caller named the implementation.
  """
  implementation: str
  config: Any
  reason: str | None

  @property
  def fallback(self) -> str | None:
    """Why "auto" runs XLA (logged once per reason), else None."""
    return self.reason if self.implementation == "xla" else None


def decide(op: str, *, m: int, k_shard: int, n: int, dtype, num_devices: int,
           implementation: str = "auto", config: Any = None, dimension: int = 0,
           out_dtype=None, axis_name=None, gpu_kind: str | None = None,
           table: Mapping[str, Any] | None = None) -> Decision:
  """Decides one call of `op`, once.

  The sizes are the tuning table's key (`pallas_rs.tuning`): the product is [m, n], each
  device contracting k_shard.

  Args:
    op: "matmul_rs": x [m, k_shard] @ w [k_shard, n] on each device, reduce-scattered along
      `dimension`. "ag_matmul": all_gather(lhs) @ rhs, lhs [m // num_devices, k_shard] gathered
      along `dimension`, rhs [k_shard, n].
    m, k_shard, n: as above.
    dtype: of the operands. out_dtype: of the product ("ag_matmul"; default `dtype`).
    num_devices: D, the size of the reduced (gathered) mesh axis.
    implementation: "xla", "fused" or "auto" (validated by the api). "fused" raises
      NotImplementedError where the kernel cannot run the call; without a config,
      "matmul_rs" runs the table's tuned config for the shape (where XLA won too: the best
      fused config measured), else the kernel's default.
    config: an explicit kernel config (`pallas_rs.Config`, or a `TuningConfig` for
      "ag_matmul"), or None.
    dimension: the scattered (gathered) dimension; the kernels take 0 only.
    axis_name: "matmul_rs" inside shard_map: the reduced axis, whose mesh
      `fused.check_mesh` checks; None skips that check.
    gpu_kind: decide for this GPU kind instead of this machine's (the shape-level decision
      of tools and tests: no platform check for "matmul_rs", the table looked up for it).
    table: a tuning table to consult instead of the active one.

  Returns:
    A `Decision`. Never "fused" for "auto" without a measurement or an explicit config.

  Raises:
    ValueError: from the kernel's checks (e.g. m not divisible by D).
    NotImplementedError: implementation="fused" where the kernel cannot run the call.
  """
  if op not in OPS:
    raise ValueError(f"{op=} must be one of {OPS}")
  if implementation == "xla":
    return Decision("xla", None, None)
  problem = dict(m=m, k_shard=k_shard, n=n, dtype=dtype, num_devices=num_devices)
  key = tuning.make_key(**problem, gpu_kind=gpu_kind or platform.device_kind())
  if op == "ag_matmul":
    return _decide_ag_matmul(key, problem, implementation, config, dimension,
                             out_dtype or dtype, table)
  return _decide_matmul_rs(key, problem, implementation, config, dimension, axis_name,
                           on_device=gpu_kind is None, table=table)


def _decide_matmul_rs(key, problem, implementation, config, dimension, axis_name, *,
                      on_device: bool, table) -> Decision:
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top  (Mosaic GPU import chain)

  def check(cfg):
    return fused.check_supported(**problem, config=cfg)

  def checked(cfg):
    return fused.CheckedConfig.of(cfg, **problem)

  if implementation == "fused":
    if dimension != 0:
      raise NotImplementedError(
          f"the fused kernel supports only scatter_dimension=0, got "
          f"scatter_dimension={dimension}; use implementation='xla' or 'auto'")
    if on_device and jax.devices()[0].platform == "gpu" and not platform.on_hopper():
      raise NotImplementedError(
          platform.not_hopper_reason("implementation='fused' (the Mosaic GPU kernel)")
          + "; use implementation='auto' or 'xla'")
    if axis_name is not None:
      fused.check_mesh(axis_name)
    if config is None and (not on_device or platform.on_hopper()):
      # The table's config has passed `check`, or is the kernel's default.
      return Decision("fused", checked(
          _table_decision(key, "matmul_rs", check, check(None), table).config), None)
    return Decision("fused", checked(check(config)), None)
  if dimension != 0:
    return Decision("xla", None,
                    f"fused kernel needs scatter_dimension=0, got scatter_dimension={dimension}")
  if on_device and not platform.on_hopper():
    return Decision("xla", None, platform.not_hopper_reason("fused kernel"))

  if axis_name is not None:
    try:
      fused.check_mesh(axis_name)
    except NotImplementedError as e:
      return Decision("xla", None, str(e))
  return _auto(key, "matmul_rs", check, checked, config, table, prefix="")


def _decide_ag_matmul(key, problem, implementation, config, dimension, out_dtype,
                      table) -> Decision:
  def check(cfg):
    return ag_matmul.check_supported(
        m_shard=problem["m"] // problem["num_devices"], k=problem["k_shard"], n=problem["n"],
        dtype=problem["dtype"], out_dtype=out_dtype, num_devices=problem["num_devices"],
        gather_dimension=dimension, config=cfg)

  if implementation == "fused":
    return Decision("fused", check(config), None)
  return _auto(key, "ag_matmul", check, lambda cfg: cfg, config, table,
               prefix="all_gather_matmul: ")


def _auto(key, op, check, checked, config, table, *, prefix) -> Decision:
  """"auto" once the platform and the mesh allow the kernel: its rules on the shape (`check`),
  an explicit config, then the table, whose configs pass `check` as the caller's do.
  `checked` wraps the config that will run."""
  try:
    default = check(config)
  except NotImplementedError as e:
    return Decision("xla", None, f"{prefix}{e}")
  if config is not None:
    return Decision("fused", checked(default),
                    f"{prefix}explicit config for {tuple(key)} (the tuning table is skipped)")
  decision = _table_decision(key, op, check, default, table)
  reason = f"{prefix}tuning ({decision.source}): {decision.reason}"
  if decision.implementation == "fused":
    return Decision("fused", checked(decision.config), reason)
  return Decision("xla", None, reason)


def _table_decision(key, op, check: Callable[[Any], Any], default,
                    table) -> tuning.Decision:
  """The table's decision for `key`; a table config must pass `check`, as a caller's does."""

  def fits(cfg) -> str | None:
    try:
      check(cfg)
    except (NotImplementedError, ValueError) as e:
      return str(e)
    return None

  return tuning.select(key, op=op, default=default, fits=fits, table=table)
