"""Custom VJP shared by every implementation of matmul + reduce-scatter, and the dispatch of
the all-gather matmul (its mirror, used by the backward pass).

Forward `y = reduce_scatter(x @ w)` along `scatter_dimension`; with the
cotangent `dy` of this device's chunk and `dy_full = all_gather(dy)` (the
cotangent of the full, unscattered product):

  dx = dy_full @ w.T      [m, n] @ [n, k_shard]
  dw = x.T @ dy_full      [k_shard, m] @ [m, n]

`dy` is [m // D, n] for scatter_dimension=0 (gathered along rows) and
[m, n // D] for scatter_dimension=1 (gathered along columns); the formulas are
the same once gathered. Residuals are the operands only. The implementations
arrive decided ("xla" | "fused", `pallas_rs.tuning.gate.decide`).
"""
from __future__ import annotations

import functools

import jax
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import mlir
import jax.numpy as jnp

from pallas_rs import platform
from pallas_rs import reference
from pallas_rs.kernel import ag_matmul
from pallas_rs.tuning import gate


def run_all_gather_matmul(lhs, rhs, axis_name, *, gather_dimension: int, out_dtype,
                          decision: gate.Decision) -> tuple[jax.Array, jax.Array]:
  """(all_gather(lhs) @ rhs, gathered lhs) by the decided implementation; logs a fallback."""
  if decision.fallback is not None:
    platform.log_fallback_once(decision.fallback)
  if decision.implementation == "xla":
    return reference.all_gather_matmul(lhs, rhs, axis_name, gather_dimension=gather_dimension,
                                       out_dtype=out_dtype)
  return ag_matmul.fused_all_gather_matmul(lhs, rhs, axis_name, config=decision.config,
                                           out_dtype=out_dtype)


_OFF_GPU_MESSAGE = (
    "pallas_rs: implementation='fused' runs a Mosaic GPU kernel, which needs a Hopper GPU "
    "(sm_90) and one process; this computation is lowered for another platform. Use "
    "implementation='auto' (the fused kernel where it is measured to win, else XLA) or "
    "'xla'.")

# Stands in for the fused kernel on platforms other than CUDA: lowering it raises
# NotImplementedError in pallas_rs's terms, where lowering the Mosaic GPU kernel for CPU would
# fail inside Pallas ("Only interpret mode is supported on CPU backend").
_fused_unavailable_p = jex_core.Primitive("pallas_rs_fused_unavailable")


def _unavailable_lowering(ctx, *args):
  del ctx, args
  raise NotImplementedError(_OFF_GPU_MESSAGE)


# Typed like its operand: a fresh array of the output shape, which like the Pallas call's output
# varies over no mesh axis (switch branches must have equal output types under check_vma).
_fused_unavailable_p.def_abstract_eval(lambda placeholder: placeholder)
mlir.register_lowering(_fused_unavailable_p, _unavailable_lowering)


def _fused_forward(x, w, axis_name, config):
  from pallas_rs.kernel import fused  # pylint: disable=g-import-not-at-top  (Mosaic GPU import chain)
  num_devices = lax.axis_size(axis_name)
  kernel = functools.partial(fused.fused_matmul_reduce_scatter, axis_name=axis_name,
                             num_devices=num_devices, config=config)
  out = jax.ShapeDtypeStruct((x.shape[0] // num_devices, w.shape[1]), x.dtype)
  # The kernel on CUDA (lowering for CUDA from a CPU machine, jax.export, keeps working);
  # anywhere else a clear NotImplementedError when the program is lowered.
  return lax.platform_dependent(
      x, w, cuda=kernel,
      default=lambda x, w: _fused_unavailable_p.bind(jnp.zeros(out.shape, out.dtype)))


def _forward(x, w, axis_name, scatter_dimension, implementation, config):
  if implementation == "xla":
    return reference.matmul_reduce_scatter(
        x, w, axis_name=axis_name, scatter_dimension=scatter_dimension)
  if implementation == "fused":
    assert scatter_dimension == 0, scatter_dimension  # gate.decide rejects others.
    return _fused_forward(x, w, axis_name, config)
  raise AssertionError(f"undecided {implementation=}")  # gate.decide decides it.


def _varying_axes(a) -> frozenset:
  """The manual mesh axes `a` varies over (its type's `mat.varying` in jax 0.10.x, `vma` in
  others)."""
  aval = jax.typeof(a)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def match_vma(x, w):
  """`x` and `w` cast to vary over the same manual mesh axes (under shard_map's check_vma; a
  no-op without it). On a multi-axis mesh x usually varies over a data axis across which w is
  replicated: the rule's dw = x.T @ dy_full varies over that axis, and must have w's type. With
  w cast to varying first, autodiff transposes the cast into a psum over the data axis: dw is
  summed across the data groups, as the gradient of a replicated weight must be."""
  vma_x, vma_w = _varying_axes(x), _varying_axes(w)
  # lax.pcast(..., to="varying") in jax 0.10.x; lax.pvary in some other versions.
  pcast = getattr(lax, "pcast", None)
  cast = ((lambda a, axes: pcast(a, axes, to="varying")) if pcast is not None
          else lambda a, axes: lax.pvary(a, axes))
  if vma_w - vma_x:
    x = cast(x, tuple(sorted(vma_w - vma_x)))
  if vma_x - vma_w:
    w = cast(w, tuple(sorted(vma_x - vma_w)))
  return x, w


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
  decision = gate.Decision("xla", None, None)
  if implementation == "fused":
    # The forward ran the fused kernel (asked for, or chosen by "auto" from a measurement):
    # the backward's all-gather matmul is gated the same way, by its own measurements.
    num_devices = lax.axis_size(axis_name)
    decision = gate.decide(
        "ag_matmul", m=dy.shape[0] * num_devices, k_shard=dy.shape[1], n=w.shape[0],
        dtype=dy.dtype, out_dtype=x.dtype, num_devices=num_devices,
        dimension=scatter_dimension, implementation="auto")
  dx, dy_full = run_all_gather_matmul(dy, w.T, axis_name, gather_dimension=scatter_dimension,
                                      out_dtype=x.dtype, decision=decision)
  return dx, reference.dot(x.T, dy_full, w.dtype)


matmul_reduce_scatter.defvjp(_fwd, _bwd)
