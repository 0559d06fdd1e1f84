"""pallas_rs.bench.testing and the loopback baseline in pallas_rs.reference (CPU)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import helpers
from pallas_rs import reference
from pallas_rs.bench import shapes
from pallas_rs.bench import testing


def test_stacked_inputs_are_random_and_distinct_per_rank():
  xs, ws = testing.stacked_inputs(3, 4, 32, 16, 24)
  assert xs.shape == (4, 32, 16) and ws.shape == (4, 16, 24) and xs.dtype == jnp.bfloat16
  x = np.asarray(xs, np.float32)
  assert np.all(np.abs(x).reshape(4, -1).max(axis=1) > 0)
  # Rank r is scaled by 1 + r / D: the per-rank RMS grows with r.
  rms = np.sqrt((x.reshape(4, -1) ** 2).mean(axis=1))
  assert np.all(np.diff(rms) > 0)
  xs2, _ = testing.stacked_inputs(4, 4, 32, 16, 24)
  assert not np.array_equal(np.asarray(xs2, np.float32), x)


def test_one_generator_global_and_per_rank_views_agree():
  d, m, k, n = 4, 32, 64, 24
  x, w = testing.generate(7, m, k, n, num_devices=d)
  assert x.shape == (m, k) and w.shape == (k, n) and x.dtype == w.dtype == jnp.bfloat16
  xs, ws = testing.stacked_inputs(7, d, m, k // d, n)
  np.testing.assert_array_equal(np.asarray(xs, np.float32),
                                np.asarray(x, np.float32).reshape(m, d, k // d).transpose(1, 0, 2))
  np.testing.assert_array_equal(np.asarray(ws, np.float32), np.asarray(w, np.float32).reshape(
      d, k // d, n))
  # Traceable with a key, same data as the compiled generator.
  x2, w2 = jax.jit(lambda key: testing.operands(key, m, k, n, num_devices=d))(jax.random.key(7))
  np.testing.assert_array_equal(np.asarray(x2, np.float32), np.asarray(x, np.float32))
  np.testing.assert_array_equal(np.asarray(w2, np.float32), np.asarray(w, np.float32))
  # D = 1: x is exactly N(0, 1) rounded, and `activations` is that x alone.
  x1, _ = testing.generate(7, m, k, n, dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(testing.activations(7, m, k, dtype=jnp.float32)),
                                np.asarray(x1))
  # Outputs O(1).
  out = testing.stacked_reference(xs, ws)
  assert 0.3 < np.sqrt(np.mean(out**2)) < 3
  with pytest.raises(ValueError, match="not divisible"):
    testing.operands(0, m, 30, n, num_devices=d)


def test_generated_in_place_on_a_mesh_and_on_the_host():
  case = shapes.by_name("ci_llama70b_o_proj_d8")
  mesh = helpers.make_mesh(case.num_devices)
  shardings = testing.row_parallel_shardings(mesh, helpers.AXIS)
  x, w = testing.generate(3, case.m, case.k, case.n, num_devices=8, shardings=shardings)
  assert x.sharding == shardings[0] and w.sharding == shardings[1]
  inputs = testing.make_inputs(case, seed=3)
  np.testing.assert_array_equal(np.asarray(x), inputs.x)
  np.testing.assert_array_equal(np.asarray(w), inputs.w)
  for d in range(8):
    np.testing.assert_array_equal(inputs.xs[d], inputs.x[:, d * case.k_shard:(d + 1) * case.k_shard])
  px, pw = testing.put_operands(inputs, mesh, helpers.AXIS)
  assert px.sharding.is_equivalent_to(x.sharding, 2) and pw.sharding.is_equivalent_to(w.sharding, 2)
  # crc32-sized seeds (tests/test_api.py) are fine.
  assert testing.make_inputs(case, seed=2**32 - 1).x.shape == (case.m, case.k)


def test_device_reference_matches_the_host_one():
  xs, ws = testing.stacked_inputs(2, 4, 64, 32, 48)
  np.testing.assert_allclose(np.asarray(testing.device_reference(xs, ws)),
                             testing.stacked_reference(xs, ws), rtol=1e-5, atol=1e-5)


def test_stacked_reference_matches_float64_einsum():
  xs, ws = testing.stacked_inputs(0, 4, 64, 32, 48)
  x64 = np.asarray(xs, np.float32).astype(np.float64)
  w64 = np.asarray(ws, np.float32).astype(np.float64)
  want = np.einsum("dmk,dkn->mn", x64, w64).reshape(4, 16, 48)
  np.testing.assert_allclose(testing.stacked_reference(xs, ws), want, rtol=1e-5, atol=1e-5)


def test_loopback_baseline_rounds_like_a_bf16_reduce_scatter():
  xs, ws = testing.stacked_inputs(1, 4, 64, 32, 48)
  got = np.asarray(reference.loopback_matmul_reduce_scatter(xs, ws), np.float32)
  bf16 = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
  x = np.asarray(xs, np.float32)
  w = np.asarray(ws, np.float32)
  parts = np.stack([bf16(x[r] @ w[r]) for r in range(4)]).reshape(4, 4, 16, 48)  # [src, dst]
  acc = parts[0]
  for src in range(1, 4):
    acc = bf16(acc + parts[src])
  # Same roundings in the same order; f32 products may differ in the last f32 bits, which
  # can flip a bf16 rounding: allow one bf16 ulp.
  np.testing.assert_allclose(got, acc, rtol=2.0**-7, atol=1e-6)
  # And it is genuinely less accurate than an fp32 sum rounded once.
  exact = testing.stacked_reference(xs, ws)
  once = bf16(exact)
  assert np.abs(got - exact).max() > np.abs(once - exact).max()


def test_unfused_order_follows_the_numerics_a_config_copies():
  from pallas_rs.kernel import config as config_lib  # pylint: disable=g-import-not-at-top
  assert testing.unfused_order(None) == "source"
  for numerics, order in (("unfused_order", "ring"), ("bf16_partials", "source"),
                          ("fp32_partials", "source")):
    partial_dtype, owner_sum = config_lib.NUMERICS_MODES[numerics]
    cfg = config_lib.Config(partial_dtype=partial_dtype, owner_sum=owner_sum,
                            epi_tile_n=32 if partial_dtype == "float32" else 64)
    assert cfg.numerics == numerics and testing.unfused_order(cfg) == order
