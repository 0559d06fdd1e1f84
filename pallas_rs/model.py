"""A Llama-style transformer block with tensor + sequence parallelism, pure JAX.

Megatron-style sequence parallelism over one mesh axis of D devices. Between
layers each device holds a token chunk h [M/D, H] of one sequence of M tokens:

  x  = rms_norm(h)                                   local
  qkv = all_gather(x) @ wqkv_d                       column-parallel (AG-matmul)
  a  = causal_attention(q, k, v)                     this device's heads
  h  = h + reduce_scatter(a @ wo_d)                  row-parallel (matmul_reduce_scatter)
  x  = rms_norm(h)
  gu = all_gather(x) @ wgate_up_d                    column-parallel (AG-matmul)
  h  = h + reduce_scatter((silu(g) * u) @ wdown_d)   row-parallel

No RoPE, no KV cache, no dropout: the block exists to time and check the two
collective matmuls in their real surroundings, not to be a model zoo.

Parameter layout (global arrays, `BlockParams`), D = num_devices:
  attn_norm, mlp_norm  [H]                      replicated
  wqkv      [H, D, (hq + 2 hkv) * head_dim]     device d's columns at [:, d]:
            its hq = heads/D query heads, then hkv = kv_heads/D key heads, then
            hkv value heads; global query head d*hq + j (kv head likewise)
  wo        [heads * head_dim, H]               rows sharded (global head order)
  wgate_up  [H, D, 2 * ffn/D]                   device d's gate then up columns
  wdown     [ffn, H]                            rows sharded (d*ffn/D + j order)
The explicit device axis of wqkv and wgate_up makes one fused matmul per
column-parallel layer without concatenating weights at run time. Sharding:
`param_specs(axis_name)`; a per-device view is 2-D after `local_params`.
`reference_block` is the same math unsharded, from the global params.

Implementations (`implementation=`): "auto" | "fused" | "xla" select the
row-parallel op (`pallas_rs.matmul_reduce_scatter`); the column-parallel
AG-matmuls (`pallas_rs.all_gather_matmul`) follow `ag_implementation` (default:
"xla" for "xla", else "auto", so that a "fused" block still runs where jax's AG
kernel does not apply). The layers are `block_forward`'s `row_parallel` and
`column_parallel` arguments, so that a benchmark can swap them (the no-communication
baseline of experiments/model_bench.py).
"""
from __future__ import annotations

from collections.abc import Mapping
import functools
import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_rs import api
from pallas_rs import reference

# The block's four collective matmuls, in program order.
LAYERS = ("qkv", "o_proj", "gate_up", "down_proj")


class BlockParams(NamedTuple):
  """Global (or, inside shard_map, per-device) parameters; see module doc."""
  attn_norm: jax.Array
  wqkv: jax.Array
  wo: jax.Array
  mlp_norm: jax.Array
  wgate_up: jax.Array
  wdown: jax.Array


def init_params(key: jax.Array, *, hidden: int, heads: int, head_dim: int,
                ffn: int, num_devices: int, kv_heads: int | None = None,
                dtype=jnp.bfloat16) -> BlockParams:
  """Random global parameters (variance-preserving scales) in `dtype`.

  Raises:
    ValueError: heads, kv_heads or ffn not divisible by num_devices, or heads
      not a multiple of kv_heads.
  """
  kv_heads = heads if kv_heads is None else kv_heads
  for name, size in (("heads", heads), ("kv_heads", kv_heads), ("ffn", ffn)):
    if size % num_devices:
      raise ValueError(f"{name}={size} must be divisible by {num_devices=}")
  if heads % kv_heads:
    raise ValueError(f"{heads=} must be a multiple of {kv_heads=}")
  hq, hkv = heads // num_devices, kv_heads // num_devices
  f_shard = ffn // num_devices
  k = jax.random.split(key, 6)

  def normal(key, shape, fan_in):
    return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)
            ).astype(dtype)

  def norm_weight(key):  # Around 1, but not exactly, so it is exercised.
    return (1.0 + 0.1 * jax.random.normal(key, (hidden,), jnp.float32)
            ).astype(dtype)

  return BlockParams(
      attn_norm=norm_weight(k[0]),
      wqkv=normal(k[1], (hidden, num_devices, (hq + 2 * hkv) * head_dim),
                  hidden),
      wo=normal(k[2], (heads * head_dim, hidden), heads * head_dim),
      mlp_norm=norm_weight(k[3]),
      wgate_up=normal(k[4], (hidden, num_devices, 2 * f_shard), hidden),
      wdown=normal(k[5], (ffn, hidden), ffn))


def param_specs(axis_name) -> BlockParams:
  """PartitionSpecs of the global params over `axis_name`."""
  return BlockParams(attn_norm=P(), wqkv=P(None, axis_name, None),
                     wo=P(axis_name, None), mlp_norm=P(),
                     wgate_up=P(None, axis_name, None), wdown=P(axis_name, None))


def shard_params(params: BlockParams, mesh: jax.sharding.Mesh,
                 axis_name) -> BlockParams:
  """`device_put` of the global params in their shardings on `mesh`."""
  if params.wqkv.shape[1] != mesh.shape[axis_name]:
    raise ValueError(f"params were made for num_devices={params.wqkv.shape[1]}"
                     f", the mesh has {mesh.shape[axis_name]=}")
  return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                      params, param_specs(axis_name))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-5) -> jax.Array:
  """RMSNorm over the last axis, computed in fp32, returned in x.dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * weight.astype(jnp.float32)).astype(x.dtype)


# ---------------------------------------------------------------------------
# Column-parallel layer: all-gather of the tokens, then this device's columns.
# ---------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def column_parallel_matmul(x, w, axis_name, implementation, ag_implementation,
                           config):
  """`all_gather(x) @ w` inside shard_map: x [m/D, k] -> [m, n_shard].

  Backward (Megatron sequence parallelism): dx = reduce_scatter(dy @ w.T), the
  row-parallel op itself (`implementation`); dw = all_gather(x).T @ dy, with x
  gathered again rather than kept (residuals are the operands only).
  """
  del implementation  # Used by the backward pass.
  out, _ = api.all_gather_matmul(x, w, axis_name, implementation=ag_implementation,
                                 config=config)
  return out


def _column_fwd(x, w, axis_name, implementation, ag_implementation, config):
  out = column_parallel_matmul(x, w, axis_name, implementation,
                               ag_implementation, config)
  return out, (x, w)


def _column_bwd(axis_name, implementation, ag_implementation, config, res, dy):
  del ag_implementation, config  # The AG kernel's config is not the RS one's.
  x, w = res
  dx = api.matmul_reduce_scatter(dy, w.T, axis_name=axis_name,
                                 implementation=implementation)
  x_full = lax.all_gather(x, axis_name, axis=0, tiled=True)
  return dx, reference.dot(x_full.T, dy, w.dtype)


column_parallel_matmul.defvjp(_column_fwd, _column_bwd)


def row_parallel(x, w, *, axis_name, implementation, config=None, layer=None):
  """`reduce_scatter(x @ w)` inside shard_map: x [M, k_shard] -> [M/D, n] (o_proj, down_proj).

  `layer` names the projection (for benchmarks that swap this function); unused here.
  """
  del layer
  return api.matmul_reduce_scatter(x, w, axis_name=axis_name,
                                   implementation=implementation, config=config)


def column_parallel(x, w, *, axis_name, implementation, ag_implementation, layer=None):
  """`all_gather(x) @ w` inside shard_map: x [M/D, H] -> [M, n_shard] (qkv, gate_up)."""
  del layer
  return column_parallel_matmul(x, w, axis_name, implementation, ag_implementation, None)


# ---------------------------------------------------------------------------
# The block.
# ---------------------------------------------------------------------------


def swiglu(gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
  """silu(gate) * up in fp32, cast to dtype: the MLP's activation, the down projection's x."""
  return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)


def local_params(params: BlockParams) -> BlockParams:
  """Per-device params as seen in shard_map -> 2-D matrices ([H, 1, c] -> [H, c])."""
  return params._replace(wqkv=params.wqkv.reshape(params.wqkv.shape[0], -1),
                         wgate_up=params.wgate_up.reshape(
                             params.wgate_up.shape[0], -1))


def _config_for(config, layer: str):
  if isinstance(config, Mapping):
    return config.get(layer)
  return config


def block_forward(params: BlockParams, h: jax.Array, *, axis_name,
                  heads: int, kv_heads: int | None = None,
                  implementation: str = "auto",
                  ag_implementation: str | None = None,
                  config: Any = None, eps: float = 1e-5,
                  attention_implementation: str | None = None,
                  row_parallel=row_parallel, column_parallel=column_parallel) -> jax.Array:
  """One block on this device's token chunk; call inside `jax.shard_map`.

  Args:
    params: this device's shards (specs `param_specs(axis_name)`): wqkv
      [H, 1, (hq + 2 hkv) * head_dim], wo [hq * head_dim, H], wgate_up
      [H, 1, 2 * ffn/D], wdown [ffn/D, H], norms [H].
    h: [M/D, H], this device's chunk of the M tokens (chunk d on device d).
    axis_name: the tensor/sequence-parallel mesh axis (D = its size).
    heads: global number of query heads (kv_heads: key/value heads, default
      heads; GQA when fewer).
    implementation: "auto" | "fused" | "xla" for the row-parallel layers.
    ag_implementation: "auto" | "fused" | "xla" for the column-parallel
      AG-matmuls; None: "xla" when implementation is "xla", else "auto".
    config: a `pallas_rs.Config` for both row-parallel layers, or a mapping
      {"o_proj": Config, "down_proj": Config}; None: the kernel's default.
    eps: RMSNorm epsilon.
    attention_implementation: passed to `jax.nn.dot_product_attention`
      (None/"xla": materialised scores; "cudnn": flash attention on GPU).
    row_parallel, column_parallel: the two layer functions (signatures of this
      module's `row_parallel` and `column_parallel`, called with `layer=` one of
      LAYERS); benchmarks swap them.

  Returns:
    [M/D, H], the block's output chunk.
  """
  api.check_implementation(implementation)
  if ag_implementation is None:
    ag_implementation = "xla" if implementation == "xla" else "auto"
  kv_heads = heads if kv_heads is None else kv_heads
  num_devices = lax.axis_size(axis_name)
  hq, hkv = heads // num_devices, kv_heads // num_devices
  p = local_params(params)
  m = h.shape[0] * num_devices
  head_dim = p.wo.shape[0] // hq
  if p.wqkv.shape[1] != (hq + 2 * hkv) * head_dim:
    raise ValueError(f"wqkv per device has {p.wqkv.shape[1]} columns, expected "
                     f"({hq=} + 2*{hkv=}) * {head_dim=} ({heads=} "
                     f"{kv_heads=} {num_devices=})")
  column = functools.partial(column_parallel, axis_name=axis_name,
                             implementation=implementation,
                             ag_implementation=ag_implementation)
  row = functools.partial(row_parallel, axis_name=axis_name, implementation=implementation)

  qkv = column(rms_norm(h, p.attn_norm, eps), p.wqkv, layer="qkv")         # [M, cols]
  q, k, v = jnp.split(qkv, [hq * head_dim, (hq + hkv) * head_dim], axis=1)
  attn = jax.nn.dot_product_attention(
      q.reshape(1, m, hq, head_dim), k.reshape(1, m, hkv, head_dim),
      v.reshape(1, m, hkv, head_dim), is_causal=True,
      implementation=attention_implementation)
  attn = attn.reshape(m, hq * head_dim)
  h = h + row(attn, p.wo, config=_config_for(config, "o_proj"), layer="o_proj")

  gate_up = column(rms_norm(h, p.mlp_norm, eps), p.wgate_up, layer="gate_up")  # [M, 2F/D]
  gate, up = jnp.split(gate_up, 2, axis=1)
  act = swiglu(gate, up, h.dtype)
  return h + row(act, p.wdown, config=_config_for(config, "down_proj"), layer="down_proj")


def make_block_fn(mesh: jax.sharding.Mesh, axis_name, *, heads: int,
                  kv_heads: int | None = None, implementation: str = "auto",
                  jit: bool = True, **kwargs):
  """`fn(params, h)` on global arrays: h [M, H] sharded P(axis_name, None).

  Applies `jax.shard_map(block_forward)` with `param_specs(axis_name)`; the
  output is [M, H] sharded like h. jitted unless `jit=False` (to compose,
  e.g. under `jax.grad` in a larger jitted function). kwargs go to
  `block_forward` (ag_implementation, config, eps, attention_implementation).
  """
  per_device = functools.partial(block_forward, axis_name=axis_name,
                                 heads=heads, kv_heads=kv_heads,
                                 implementation=implementation, **kwargs)
  # check_vma=False: the Pallas kernels carry no varying-axes annotations.
  fn = jax.shard_map(per_device, mesh=mesh,
                     in_specs=(param_specs(axis_name), P(axis_name, None)),
                     out_specs=P(axis_name, None), check_vma=False)
  return jax.jit(fn) if jit else fn


def make_loss_fn(mesh, axis_name, **kwargs):
  """`loss(params, h) = mean(block(params, h)**2)` in fp32 (not jitted)."""
  block = make_block_fn(mesh, axis_name, jit=False, **kwargs)

  def loss(params, h):
    return jnp.mean(jnp.square(block(params, h).astype(jnp.float32)))

  return loss


# ---------------------------------------------------------------------------
# Unsharded reference (tests): the same math on one device, written out.
# ---------------------------------------------------------------------------


def reference_block(params: BlockParams, h: jax.Array, *, heads: int,
                    kv_heads: int | None = None, eps: float = 1e-5
                    ) -> jax.Array:
  """The block on global arrays h [M, H] with global params; plain jnp.

  Decodes the device-major layout of wqkv / wgate_up (module docstring) into
  global wq, wk, wv, wgate, wup and runs softmax attention with an explicit
  causal mask. Computes in h's dtype with HIGHEST precision (use float32).
  """
  dot = functools.partial(jnp.dot, precision=lax.Precision.HIGHEST)
  kv_heads = heads if kv_heads is None else kv_heads
  hidden, num_devices, _ = params.wqkv.shape
  hq, hkv = heads // num_devices, kv_heads // num_devices
  head_dim = params.wo.shape[0] // heads
  m = h.shape[0]
  wq, wk, wv = jnp.split(params.wqkv, [hq * head_dim, (hq + hkv) * head_dim],
                         axis=2)
  wq, wk, wv = (a.reshape(hidden, -1) for a in (wq, wk, wv))
  wgate, wup = (a.reshape(hidden, -1)
                for a in jnp.split(params.wgate_up, 2, axis=2))

  x = rms_norm(h, params.attn_norm, eps)
  q = dot(x, wq).reshape(m, heads, head_dim)
  k = dot(x, wk).reshape(m, kv_heads, head_dim)
  v = dot(x, wv).reshape(m, kv_heads, head_dim)
  group = heads // kv_heads
  k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
  scores = jnp.einsum("qhd,khd->hqk", q, k,
                      precision=lax.Precision.HIGHEST) / math.sqrt(head_dim)
  causal = jnp.tril(jnp.ones((m, m), bool))
  probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
  attn = jnp.einsum("hqk,khd->qhd", probs, v,
                    precision=lax.Precision.HIGHEST).reshape(m, -1)
  h = h + dot(attn, params.wo)

  x = rms_norm(h, params.mlp_norm, eps)
  act = jax.nn.silu(dot(x, wgate)) * dot(x, wup)
  return h + dot(act, params.wdown)
