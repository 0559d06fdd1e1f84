"""The no-communication baseline of the tensor-parallel block (benchmarks only).

The block of `pallas_rs.model` with the collectives of some layers replaced by local ops of
the same shapes that move no data between devices; `T(block) - T(no-comm block)` is the
communication the block still waits for (experiments/model_bench.py). Numerically
meaningless: timing only.

A fair baseline must do the same FLOPs and memory traffic as the real block, forward and
backward, minus the collectives. So each replacement mirrors the real layer's custom VJP
(`pallas_rs.vjp` for the row-parallel op, `model.column_parallel_matmul` for the
column-parallel one) matmul for matmul, in the same dtypes (bf16 operands, fp32
accumulation, rounded to bf16): differentiating a plain `jnp.dot(..., f32).astype(bf16)`
instead would run the backward's matmuls in fp32 (twice the time of the real block's bf16
ones on a GPU). The collectives become:

  all_gather      [M/D, H] -> [M, H]: D local copies (`jnp.tile`);
  reduce_scatter  [M, H] -> [M/D, H]: the sum of the D row chunks of the local product (reads
                  all of it, as the reduce-scatter does; no slicing that XLA could fold into a
                  smaller matmul).

`tests/test_model_bench.py` checks on CPU that the no-comm program has no collective and the
same dot FLOPs as the real block, forward and forward+backward.
"""
from __future__ import annotations

from collections.abc import Iterable
import functools
import math
import re

import jax
from jax import lax
import jax.numpy as jnp

from pallas_rs import model
from pallas_rs import reference

LAYERS = model.LAYERS


def _dot(a, b, dtype):
  return reference.dot(a, b, dtype)


def _local_gather(x, axis_name):
  """[M/D, H] -> [M, H] without communication."""
  return jnp.tile(x, (lax.axis_size(axis_name), 1))


def _local_scatter(y, axis_name):
  """[M, H] -> [M/D, H] without communication: the sum of the D row chunks."""
  d = lax.axis_size(axis_name)
  return y.reshape(d, y.shape[0] // d, y.shape[1]).sum(axis=0, dtype=y.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def row_parallel_matmul(x, w, axis_name):
  """`pallas_rs.vjp.matmul_reduce_scatter` (XLA path) without the reduce-scatter."""
  return _local_scatter(_dot(x, w, x.dtype), axis_name)


def _row_fwd(x, w, axis_name):
  return row_parallel_matmul(x, w, axis_name), (x, w)


def _row_bwd(axis_name, res, dy):
  x, w = res
  dy_full = _local_gather(dy, axis_name)           # the real one all-gathers dy
  return _dot(dy_full, w.T, x.dtype), _dot(x.T, dy_full, w.dtype)


row_parallel_matmul.defvjp(_row_fwd, _row_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def column_parallel_matmul(x, w, axis_name):
  """`pallas_rs.model.column_parallel_matmul` without the all-gathers and reduce-scatter."""
  return _dot(_local_gather(x, axis_name), w, x.dtype)


def _column_fwd(x, w, axis_name):
  return column_parallel_matmul(x, w, axis_name), (x, w)


def _column_bwd(axis_name, res, dy):
  x, w = res
  dx = row_parallel_matmul(dy, w.T, axis_name)     # the real one is the row-parallel op
  x_full = _local_gather(x, axis_name)             # the real one all-gathers x again
  return dx, _dot(x_full.T, dy, w.dtype)


column_parallel_matmul.defvjp(_column_fwd, _column_bwd)


def layer_functions(without: Iterable[str]) -> dict[str, object]:
  """`block_forward`'s row_parallel and column_parallel with the layers `without` local.

  Args:
    without: names from `model.LAYERS` whose collectives are removed; the other layers run
      the real ones (`model.row_parallel` / `model.column_parallel`).
  """
  without = frozenset(without)
  unknown = sorted(without - set(LAYERS))
  if unknown:
    raise ValueError(f"unknown layers {unknown}; known: {LAYERS}")

  def row(x, w, *, axis_name, implementation, config=None, layer=None):
    if layer in without:
      return row_parallel_matmul(x, w, axis_name)
    return model.row_parallel(x, w, axis_name=axis_name, implementation=implementation,
                              config=config)

  def column(x, w, *, axis_name, implementation, ag_implementation, layer=None):
    if layer in without:
      return column_parallel_matmul(x, w, axis_name)
    return model.column_parallel(x, w, axis_name=axis_name, implementation=implementation,
                                 ag_implementation=ag_implementation)

  return {"row_parallel": row, "column_parallel": column}


# ---------------------------------------------------------------------------
# What a compiled program does: dot FLOPs and collectives, from its HLO text.
# ---------------------------------------------------------------------------

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute",
               "all-to-all", "collective-broadcast", "ragged-all-to-all")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[a-z0-9]+\[([0-9,]*)\]\S*\s+([\w\-]+)\((.*)$")


def _dims(text: str) -> list[int]:
  return [int(v) for v in text.split(",") if v]


def dot_flops(hlo_text: str) -> int:
  """2 * output elements * contracted size, summed over the `dot` instructions of an HLO module
  (compiled text: operand shapes are looked up by name)."""
  shapes, dots = {}, []
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    name, dims, opcode, rest = m.groups()
    shapes[name] = _dims(dims)
    if opcode == "dot":
      lhs = rest.split(",")[0].strip().split()[-1].lstrip("%")
      contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
      dots.append((_dims(dims), lhs, _dims(contracting.group(1)) if contracting else []))
  total = 0
  for out, lhs, contracting in dots:
    total += 2 * math.prod(out) * math.prod(shapes[lhs][i] for i in contracting)
  return total


def collectives(hlo_text: str) -> list[str]:
  """The collective instructions (opcode names) in `hlo_text`, in order."""
  ops = re.findall(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", hlo_text)
  return ops


# ---------------------------------------------------------------------------
# The benchmark's programs: forward, and forward+backward per device.
# ---------------------------------------------------------------------------


def block_functions(mesh, axis_name, *, without: Iterable[str] = (), **block_kw):
  """{"forward": jit(fn(params, h)), "forward_backward": jit(fn(params, h))} of one variant.

  forward_backward is `value_and_grad` of the per-device loss mean(block(h)**2) taken inside
  shard_map: every variant's gradients are per device (the norm weights' gradients are not
  summed over devices, and the loss is not averaged over devices), so the only collectives of
  a program are those of the four layers, and the no-comm variant has none.
  """
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  kw = dict(block_kw, **layer_functions(without))
  forward = model.make_block_fn(mesh, axis_name, **kw)

  def local(params, h):
    def loss(params, h):
      out = model.block_forward(params, h, axis_name=axis_name, **kw)
      return jnp.mean(jnp.square(out.astype(jnp.float32)))
    value, grads = jax.value_and_grad(loss, argnums=(0, 1))(params, h)
    return value[None], grads

  specs = model.param_specs(axis_name)
  grad_specs = specs._replace(attn_norm=P(axis_name), mlp_norm=P(axis_name))
  forward_backward = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(specs, P(axis_name, None)),
      out_specs=(P(axis_name), (grad_specs, P(axis_name, None))), check_vma=False))
  return {"forward": forward, "forward_backward": forward_backward}
