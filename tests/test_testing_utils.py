"""pallas_rs.testing and the loopback baseline in pallas_rs.reference (CPU)."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_rs import reference
from pallas_rs import testing


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
