"""Row-parallel operands for the tests and experiments (the one input generator), and oracles.

Rank r of D holds the k-slice r of the global operands (docs/design.md section 1):
x_r = x[:, r k/D : (r+1) k/D] [m, k/D] and w_r = w[r k/D : (r+1) k/D] [k/D, n]. `operands`
draws the global x [m, k], w [k, n] (`generate`: compiled, optionally in their shardings;
`activations`: x alone); `split_inputs` is the stacked per-rank view xs [D, m, k/D],
ws [D, k/D, n] of the same data. The data is random normal, never zero,
different on every rank (rank r's x is scaled by 1 + r / D, so a swapped, missing or duplicated
rank changes the result), and the outputs are O(1) (w is scaled by 1 / sqrt(k)).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from pallas_rs import reference


def operands(key, m: int, k: int, n: int, *, num_devices: int = 1,
             dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
  """Global x [m, k] and w [k, n] in `dtype`, rank r's k-slice of x scaled by 1 + r / D.

  Traceable (jit, vmap). `key`: a PRNG key or an int seed (traced or not). At D = 1, x is
  exactly N(0, 1) rounded to `dtype`.
  """
  if k % num_devices:
    raise ValueError(f"k={k} not divisible by num_devices={num_devices}")
  if not jnp.issubdtype(getattr(key, "dtype", int), jax.dtypes.prng_key):
    key = jax.random.key(key)
  kx, kw = jax.random.split(key)
  rank_scale = 1.0 + jnp.arange(num_devices, dtype=jnp.float32) / num_devices
  x = jax.random.normal(kx, (m, k), jnp.float32) * jnp.repeat(rank_scale, k // num_devices)
  w = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
  return x.astype(dtype), w.astype(dtype)


@functools.lru_cache(maxsize=None)
def _generator(m, k, n, num_devices, dtype, shardings):
  return jax.jit(functools.partial(operands, m=m, k=k, n=n, num_devices=num_devices,
                                   dtype=dtype), out_shardings=shardings)


def generate(key, m: int, k: int, n: int, *, num_devices: int = 1, dtype=jnp.bfloat16,
             shardings=None) -> tuple[jax.Array, jax.Array]:
  """`operands`, compiled once per shape; with `shardings` (x's, w's, e.g.
  `row_parallel_shardings`) each device generates only its own blocks."""
  if isinstance(key, int):
    key = jax.random.key(key)  # Python ints beyond int32 (crc32 seeds) too.
  return _generator(m, k, n, num_devices, jnp.dtype(dtype), shardings)(key)


@functools.lru_cache(maxsize=None)
def _activations(m, k, dtype, sharding):
  return jax.jit(lambda key: operands(key, m, k, 1, dtype=dtype)[0], out_shardings=sharding)


def activations(key, m: int, k: int, *, dtype=jnp.bfloat16, sharding=None) -> jax.Array:
  """x [m, k] of `generate` at D = 1 alone (N(0, 1)), e.g. a block's input; `sharding`:
  generated in place."""
  if isinstance(key, int):
    key = jax.random.key(key)
  return _activations(m, k, jnp.dtype(dtype), sharding)(key)


def row_parallel_shardings(mesh, axis_name) -> tuple[NamedSharding, NamedSharding]:
  """Shardings of global x [m, k] (P(None, axis)) and w [k, n] (P(axis, None)) on `mesh`."""
  return NamedSharding(mesh, P(None, axis_name)), NamedSharding(mesh, P(axis_name, None))


def split_inputs(x, w, num_devices: int):
  """Global x [m, k], w [k, n] -> xs [D, m, k / D], ws [D, k / D, n] (rank d: k-slice d).

  Works on numpy and jax arrays.
  """
  m, k = x.shape
  if k % num_devices:
    raise ValueError(f"k={k} not divisible by D={num_devices}")
  ks = k // num_devices
  xs = x.reshape(m, num_devices, ks).transpose(1, 0, 2)
  ws = w.reshape(num_devices, ks, w.shape[1])
  return xs, ws


def stacked_inputs(key, num_devices: int, m: int, k_shard: int, n: int,
                   dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
  """Per-rank operands xs [D, m, k_shard], ws [D, k_shard, n]: `split_inputs` of
  `generate(key, m, D * k_shard, n, num_devices=D)` (one GPU: loopback, D = 1)."""
  x, w = generate(key, m, num_devices * k_shard, n, num_devices=num_devices, dtype=dtype)
  return split_inputs(x, w, num_devices)


@dataclasses.dataclass(frozen=True)
class Inputs:
  """One problem's operands on the host (numpy, in the case's dtype), both views.

  Attributes:
    xs: [D, m, k_shard], device d's x.
    ws: [D, k_shard, n], device d's w.
    x: [m, k] global activations (xs concatenated along k).
    w: [k, n] global weight (ws concatenated along k).
  """
  xs: np.ndarray
  ws: np.ndarray
  x: np.ndarray
  w: np.ndarray


def make_inputs(case, seed: int = 0) -> Inputs:
  """`generate`'s operands of a `pallas_rs.shapes.Case`, on the host."""
  d = case.num_devices
  x, w = (np.asarray(a) for a in generate(seed, case.m, case.k, case.n, num_devices=d,
                                          dtype=case.dtype))
  xs, ws = split_inputs(x, w, d)
  return Inputs(xs=np.ascontiguousarray(xs), ws=ws, x=x, w=w)


def put_operands(inputs: Inputs, mesh, axis_name):
  """Global x, w of `inputs` on `mesh`, sharded as `row_parallel_shardings`."""
  x_sharding, w_sharding = row_parallel_shardings(mesh, axis_name)
  return jax.device_put(inputs.x, x_sharding), jax.device_put(inputs.w, w_sharding)


def stacked_reference(xs, ws) -> np.ndarray:
  """[D, m // D, n]: row chunk r of sum_s xs[s] @ ws[s], on the host.

  Per-rank float32 BLAS products (relative error ~1e-6, far below bf16 rounding), summed over
  ranks in float64: fast enough for the full seed shapes, unlike a float64 einsum.
  """
  x = np.asarray(jnp.asarray(xs).astype(jnp.float32))
  w = np.asarray(jnp.asarray(ws).astype(jnp.float32))
  d, m, _ = x.shape
  full = sum(np.matmul(x[r], w[r]).astype(np.float64) for r in range(d))
  return full.reshape(d, m // d, -1)


def unfused_order(config) -> str:
  """The order in which the loopback emulation of the unfused path
  (`reference.loopback_matmul_reduce_scatter`) sums, to judge `config` by the error rule: NCCL's
  ring order for a config in the ring's numerics ("unfused_order", which copies it bit for
  bit), else source order. At D > 2 the two orders' errors differ by up to ~1.3x on one input,
  so a ring config judged against source order can break the rule with the unfused path's own
  arithmetic (BUILD_NOTES 2026-12-01 twelfth session, 2026-12-02 fourteenth)."""
  return "ring" if config is not None and config.numerics == "unfused_order" else "source"


@functools.cache
def loopback_unfused(order: str = "source"):
  """`reference.loopback_matmul_reduce_scatter` summing in `order`, jitted once per order (a
  fresh jit of a fresh partial would compile again at every call site)."""
  return jax.jit(functools.partial(reference.loopback_matmul_reduce_scatter, order=order))


@jax.jit
def device_reference(xs, ws) -> jax.Array:
  """`stacked_reference` on the device, in float32 (HIGHEST precision): [D, m // D, n].

  For checks whose operands are too large or too many to copy to the host (stress loops).
  """
  d, m, _ = xs.shape
  ref = jnp.einsum("dmk,dkn->mn", xs.astype(jnp.float32), ws.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  return ref.reshape(d, m // d, -1)


# Input families of the numerics experiments (pallas_rs.bench.numerics re-exports them).
FAMILIES = ("gaussian", "channel_scaled", "outliers", "llm_weights")
# channel_scaled: per-channel (column of x) scale exp(N(0, CHANNEL_LOG_SIGMA^2)).
CHANNEL_LOG_SIGMA = 1.0
# outliers: this many channels of x scaled by a log-uniform factor in OUTLIER_SCALE.
NUM_OUTLIER_CHANNELS = 4
OUTLIER_SCALE = (10.0, 100.0)
# llm_weights: w Laplace with standard deviation WEIGHT_STD (trained-weight magnitude; heavier
# tails than a Gaussian, cheap to sample on device).
WEIGHT_STD = 0.02


def family_scales(key, family, k: int):
  """(per-channel scale of x [k] (float32), weight sampler name) for `family`.

  `family` is a name or an int index into FAMILIES (a traced int selects with lax.switch).
  """

  def gaussian(key):
    del key
    return jnp.ones((k,), jnp.float32)

  def channel_scaled(key):
    return jnp.exp(CHANNEL_LOG_SIGMA * jax.random.normal(key, (k,), jnp.float32))

  def outliers(key):
    kc, ks = jax.random.split(key)
    idx = jax.random.choice(kc, k, (NUM_OUTLIER_CHANNELS,), replace=False)
    lo, hi = np.log(OUTLIER_SCALE[0]), np.log(OUTLIER_SCALE[1])
    s = jnp.exp(jax.random.uniform(ks, (NUM_OUTLIER_CHANNELS,), jnp.float32, lo, hi))
    return jnp.ones((k,), jnp.float32).at[idx].set(s)

  branches = [gaussian, channel_scaled, outliers, gaussian]  # llm_weights: x as gaussian
  if isinstance(family, str):
    return branches[FAMILIES.index(family)](key)
  return jax.lax.switch(family, branches, key)


def family_inputs(key, family, *, m: int, k: int, n: int):
  """Global bf16 x [m, k] and w [k, n] of `family` (name or int index, traced or not).

  gaussian:       x ~ N(0, 1), w ~ N(0, 1) / sqrt(k) (outputs O(1)).
  channel_scaled: x[:, c] ~ N(0, s_c^2), s_c = exp(CHANNEL_LOG_SIGMA * N(0, 1)) (per-channel
                  activation scales, as after a norm layer's gain); w as gaussian.
  outliers:       as gaussian, with NUM_OUTLIER_CHANNELS random channels of x scaled by a
                  log-uniform factor in OUTLIER_SCALE (10-100x, as LLM activations have).
  llm_weights:    x ~ N(0, 1), w ~ Laplace with std WEIGHT_STD (trained-weight scale, heavy
                  tails; outputs O(WEIGHT_STD * sqrt(k)), not O(1)).
  """
  kx, kw, ks = jax.random.split(key, 3)
  scale = family_scales(ks, family, k)
  x = jax.random.normal(kx, (m, k), jnp.float32) * scale[None, :]

  def w_gauss(kw):
    return jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)

  def w_llm(kw):
    return (WEIGHT_STD / np.sqrt(2.0)) * jax.random.laplace(kw, (k, n), jnp.float32)

  w_branches = [w_gauss, w_gauss, w_gauss, w_llm]
  if isinstance(family, str):
    w = w_branches[FAMILIES.index(family)](kw)
  else:
    w = jax.lax.switch(family, w_branches, kw)
  # Round with reduce_precision before the cast: XLA (excess precision, on by default) may elide
  # a later convert(convert(v, bf16), f32) pair, e.g. in an fp32 reference computed from these
  # inputs, and would then see the unrounded fp32 values; rounded values survive that.
  rnd = lambda v: jax.lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7)
  return rnd(x).astype(jnp.bfloat16), rnd(w).astype(jnp.bfloat16)
