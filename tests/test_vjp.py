"""Custom VJP of matmul_reduce_scatter, jit/grad composition and an MLP (CPU)."""
import functools
import zlib

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import pallas_rs
from pallas_rs import reference
from pallas_rs.bench import shapes
from pallas_rs.bench import testing
from pallas_rs import vjp

AXIS = helpers.AXIS
P = jax.sharding.PartitionSpec


def _seed(*parts) -> int:
  return zlib.crc32(repr(parts).encode())


def _vjp_body(x, w, dy, *, op, scatter_dimension):
  y, pullback = jax.vjp(
      lambda x, w: op(x, w, axis_name=AXIS,
                      scatter_dimension=scatter_dimension), x, w)
  return (y, *pullback(dy))


@functools.lru_cache(maxsize=None)
def _vjp_fn(op, mesh, scatter_dimension):
  """jit(shard_map) of (y, dx, dw) on global x [m, k], w [k, n], dy [m, n]."""
  out_spec = helpers.shard_spec(scatter_dimension)
  body = functools.partial(_vjp_body, op=op, scatter_dimension=scatter_dimension)
  return jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(P(None, AXIS), P(AXIS, None), out_spec),
      out_specs=(out_spec, P(None, AXIS), P(AXIS, None)), check_vma=False))


def _ours(implementation):
  return functools.partial(pallas_rs.matmul_reduce_scatter,
                           implementation=implementation)


# jax.vjp of the plain XLA composition: autodiff, no custom VJP.
_REFERENCE = reference.matmul_reduce_scatter


def autodiff_tolerance(dtype) -> float:
  """Our VJP vs autodiff of the reference: the same fp32-accumulated matmuls,
  rounded once to `dtype`; only summation order differs, so one ulp (2u)."""
  return max(2 * helpers.UNIT_ROUNDOFF[str(dtype)], 1e-6)


@pytest.mark.parametrize(
    "case,scatter_dimension,implementation",
    [pytest.param(c, 0, impl, id=f"{c.name}-dim0-{impl}", marks=helpers.ci_marks(c))
     for c in shapes.select("ci") for impl in ("xla", "auto")]
    + [pytest.param(c, 1, "xla", id=f"{c.name}-dim1-xla", marks=helpers.ci_marks(c))
       for c in shapes.select("ci") if c.n % c.num_devices == 0])
def test_vjp(case, scatter_dimension, implementation):
  mesh = helpers.make_mesh(case.num_devices)
  inputs = testing.make_inputs(case, seed=_seed(case.name, scatter_dimension))
  x, w = testing.put_operands(inputs, mesh, AXIS)
  # dy: distinct per device, [D, m // D, n] or [D, m, n // D] per-device blocks.
  dy_shape = helpers.reference_output(inputs, scatter_dimension).shape[1:]
  dys = helpers.random_per_device(dy_shape, case.num_devices, case.dtype,
                                  seed=_seed(case.name, "dy"))
  dy_full = np.concatenate(list(dys), axis=scatter_dimension)  # [m, n]

  y, dx, dw = _vjp_fn(_ours(implementation), mesh, scatter_dimension)(
      x, w, dy_full)
  y_ref, dx_ref, dw_ref = _vjp_fn(_REFERENCE, mesh, scatter_dimension)(
      x, w, dy_full)
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  assert dx.shape == x.shape and dw.shape == w.shape

  # Against autodiff of the reference (the custom VJP must be the same rule).
  tol = autodiff_tolerance(case.dtype)
  helpers.assert_close(dx, dx_ref, tol=tol, name="dx vs jax.vjp(reference)")
  helpers.assert_close(dw, dw_ref, tol=tol, name="dw vs jax.vjp(reference)")
  if implementation == "xla":
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))

  # Against the analytic formulas in float64: dx = dy_full @ w.T,
  # dw = x.T @ dy_full (global arrays: device d's blocks are slices of these).
  dy64 = dy_full.astype(np.float64)
  tol = helpers.grad_tolerance(case.dtype)
  helpers.assert_close(dx, dy64 @ inputs.w.astype(np.float64).T, tol=tol,
                       name="dx vs numpy")
  helpers.assert_close(dw, inputs.x.astype(np.float64).T @ dy64, tol=tol,
                       name="dw vs numpy")


def test_all_gather_matmul_returns_gathered_operand():
  mesh = helpers.make_mesh(4)
  for dim in (0, 1):
    lhs, rhs = (np.asarray(a) for a in testing.generate(dim, 16, 12, 5, dtype=jnp.float32))

    def body(lhs_blk, rhs, dim=dim):
      out, full = reference.all_gather_matmul(lhs_blk, rhs, AXIS,
                                        gather_dimension=dim)
      return out, full

    in_spec = helpers.shard_spec(dim)
    out, full = jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=(in_spec, P()), out_specs=(P(AXIS), P(AXIS)),
        check_vma=False))(lhs, rhs)
    # Every device holds the full product and the full lhs.
    np.testing.assert_allclose(np.asarray(out).reshape(4, 16, 5),
                               np.broadcast_to(lhs @ rhs, (4, 16, 5)),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(full).reshape(4, 16, 12),
                                  np.broadcast_to(lhs, (4, 16, 12)))


def test_fused_backward_uses_gated_all_gather_matmul():
  # The backward of implementation="fused" goes through ag_matmul's gate; off Hopper it falls
  # back to XLA and must give exactly the XLA backward.
  mesh = helpers.make_mesh(4)
  x, w = (np.asarray(a) for a in testing.generate(1, 16, 8, 6, num_devices=4,
                                                   dtype=jnp.float32))  # global [m, k], [k, n]
  dy = np.random.default_rng(1).standard_normal((16, 6)).astype(np.float32)  # [m, n], rows sharded

  def bwd(impl, x, w, dy):
    return vjp._bwd(AXIS, 0, impl, None, (x, w), dy)

  def run(impl):
    return jax.jit(jax.shard_map(
        functools.partial(bwd, impl), mesh=mesh,
        in_specs=(P(None, AXIS), P(AXIS, None), P(AXIS, None)),
        out_specs=(P(None, AXIS), P(AXIS, None)), check_vma=False))(x, w, dy)

  for got, want in zip(run("fused"), run("xla")):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  dx, dw = run("xla")
  np.testing.assert_allclose(np.asarray(dx), dy @ w.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), x.T @ dy, rtol=1e-5, atol=1e-5)


# --- composition: jit, grad, MLP --------------------------------------------


def test_grad_inside_jit_of_row_parallel_matmul():
  case = shapes.by_name("ci_f32_n96_d4")
  mesh = helpers.make_mesh(case.num_devices)
  inputs = testing.make_inputs(case)
  x, w = testing.put_operands(inputs, mesh, AXIS)

  def loss(x, w):
    y = pallas_rs.row_parallel_matmul(x, w, mesh=mesh, axis_name=AXIS)
    return jnp.sum(jnp.sin(y))

  def loss_global(x, w):
    return jnp.sum(jnp.sin(jnp.dot(x, w, precision="highest")))

  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
  value_ref, grads_ref = jax.value_and_grad(loss_global, argnums=(0, 1))(
      jnp.asarray(inputs.x), jnp.asarray(inputs.w))
  np.testing.assert_allclose(value, value_ref, rtol=1e-5)
  for g, g_ref in zip(grads, grads_ref):
    helpers.assert_close(g, g_ref, tol=1e-5, name="grad")


def _mlp_loss(h, w1, w2, *, op, mesh, check_vma):
  """Sequence-parallel MLP: h [m, d_model] sharded by rows.

  Layer 1 is column-parallel on the all-gathered input, layer 2 row-parallel
  through `op` (matmul + reduce-scatter back to row shards).
  """

  def body(h, w1, w2):
    h_full = lax.all_gather(h, AXIS, axis=0, tiled=True)  # [m, d_model]
    a = jax.nn.gelu(jnp.dot(h_full, w1, preferred_element_type=jnp.float32)
                    .astype(h.dtype))  # [m, d_ff // D]
    out = op(a, w2, axis_name=AXIS)  # [m // D, d_model]
    return lax.psum(jnp.sum(out.astype(jnp.float32) ** 2), AXIS)

  return jax.shard_map(body, mesh=mesh,
                       in_specs=(P(AXIS, None), P(None, AXIS), P(AXIS, None)),
                       out_specs=P(), check_vma=check_vma)(h, w1, w2)


# Two of the four (dtype, check_vma) pairs in the slow layer: each value is in a fast pair.
@pytest.mark.parametrize("check_vma,dtype", [
    (True, "float32"), (False, "bfloat16"),
    pytest.param(True, "bfloat16", marks=pytest.mark.slow),
    pytest.param(False, "float32", marks=pytest.mark.slow)])
def test_mlp_gradient_matches_xla_only(check_vma, dtype):
  num_devices, m, d_model, d_ff = 4, 16, 32, 64
  mesh = helpers.make_mesh(num_devices)
  np_dt = helpers.np_dtype(dtype)
  h, w1 = (np.asarray(a) for a in testing.generate(1, m, d_model, d_ff, dtype=dtype))
  w2 = np.asarray(testing.generate(2, m, d_ff, d_model, dtype=dtype)[1])

  def grads(op):
    loss = functools.partial(_mlp_loss, op=op, mesh=mesh, check_vma=check_vma)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(h, w1, w2)

  value, g = grads(pallas_rs.matmul_reduce_scatter)
  value_ref, g_ref = grads(reference.matmul_reduce_scatter)
  # Same maths, differences only from summation order in the backward pass.
  tol = autodiff_tolerance(dtype) * (1 if dtype == "float32" else 2)
  np.testing.assert_allclose(value, value_ref, rtol=tol)
  for name, a, b in zip(("dh", "dw1", "dw2"), g, g_ref):
    assert a.dtype == b.dtype == np_dt
    helpers.assert_close(a, b, tol=tol, name=name)
  if dtype == "float32":
    # And the unsharded single-device MLP agrees (shard_map plumbing is right).
    def loss_global(h, w1, w2):
      return jnp.sum((jax.nn.gelu(h @ w1) @ w2) ** 2)

    g_global = jax.grad(loss_global, argnums=(0, 1, 2))(h, w1, w2)
    for name, a, b in zip(("dh", "dw1", "dw2"), g, g_global):
      helpers.assert_close(a, b, tol=1e-5, name=f"{name} vs unsharded")
