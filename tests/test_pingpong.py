"""The ping-pong GEMM core (pallas_rs.kernel.pingpong): its config's checks, its lowering for
CUDA at issue 19's two misses, and its numerics in Mosaic GPU's interpret mode on CPU (every
output element against an fp64 product, uninitialised memory poisoned to NaN)."""
import functools

import jax
import jax.numpy as jnp
import pytest

import helpers
from pallas_rs.bench import testing
from pallas_rs.kernel import config as config_lib
from pallas_rs.kernel import fused
from pallas_rs.kernel import pingpong

PP = pingpong.PingPongConfig


@pytest.mark.parametrize("kwargs,match", [
    (dict(tile_m=96), "tile_m"),
    (dict(tile_n=96), "tile_n"),
    (dict(tile_n=320), "tile_n"),
    (dict(tile_m=128, tile_n=256), "accumulator"),
    (dict(tile_k=32), "tile_k"),
    (dict(stages=1), "stages"),
    (dict(epi_tile_n=48), "epilogue"),
    (dict(num_sms=0), "num_sms"),
    (dict(cluster_m=4), "cluster_m"),
    (dict(cluster_m=2, num_sms=133), "multiple of cluster_m"),
])
def test_config_rejects(kwargs, match):
  with pytest.raises(ValueError, match=match):
    PP(**kwargs)


def test_check_shape():
  PP().check_shape(m=2048, n=8192, k=1024)
  with pytest.raises(ValueError, match="multiples"):
    PP().check_shape(m=2048 + 64, n=8192, k=1024)
  with pytest.raises(ValueError, match="SMEM"):
    PP(stages=7).check_shape(m=2048, n=8192, k=1024)  # 7 x 32 KB + the store slots
  assert PP(stages=6).smem_bytes() == 6 * 32768 + 2 * 2 * 8192
  with pytest.raises(ValueError, match="256 x 128"):  # a cluster's two 128-row tiles
    PP(cluster_m=2).check_shape(m=128 * 3, n=8192, k=1024)


def test_matmul_rejects_bad_operands():
  x = jnp.zeros((256, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="bf16"):
    pingpong.matmul(x, jnp.zeros((64, 128), jnp.bfloat16))
  with pytest.raises(ValueError, match="bf16"):
    pingpong.matmul(x.astype(jnp.float32), jnp.zeros((128, 128), jnp.float32))


# Issue 19's misses: Llama-3 70B o_proj and Mixtral 8x22B o_proj at M = 2048, D = 8's k_shard.
@pytest.mark.parametrize("m,k,n,cfg", [
    (2048, 1024, 8192, PP(stages=6)),
    (2048, 768, 6144, PP(stages=5, grid_minor_dim=pingpong.MatmulDimension.M,
                         grid_tile_width=8)),
    (2048, 768, 6144, PP(tile_m=64, tile_n=256, stages=4, epi_tile_n=128)),
    (2048, 1024, 8192, PP(stages=6, cluster_m=2)),  # w's blocks multicast to a CTA pair
])
def test_lowers_for_cuda(m, k, n, cfg):
  sds = jax.ShapeDtypeStruct
  exported = jax.export.export(jax.jit(functools.partial(pingpong.matmul, config=cfg)),
                               platforms=["cuda"])(sds((m, k), jnp.bfloat16),
                                                   sds((k, n), jnp.bfloat16))
  assert "pallas_rs_pingpong_matmul" in exported.mlir_module()


interpret = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params")
interpret_call = pytest.importorskip(
    "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")


# 15-20 s each in interpret mode on 2 CPU cores: the slow layer (tests/conftest.py).
@pytest.mark.slow
@pytest.mark.parametrize("m,k,n,cfg", [
    # 24 tiles on 5 CTAs (5, 5, 5, 5 and 4: warpgroup 1 has one fewer on the last), 3 k blocks
    # on a ring of 2 slots: a consumer skips an odd number of each slot's phases per tile.
    (384, 192, 256, PP(tile_m=64, tile_n=64, stages=2, num_sms=5)),
    # Two-row-block wgmma tiles, 4 tiles on 3 CTAs (one has a tile for warpgroup 1, two not),
    # 4 blocks on 3 slots; the snake along M.
    (256, 256, 256, PP(tile_m=128, tile_n=128, stages=3, num_sms=3,
                       grid_minor_dim=pingpong.MatmulDimension.M, grid_tile_width=2)),
])
def test_matmul_interpret(m, k, n, cfg):
  # The interpreter also fails a barrier protocol it can see broken (a phase completed again
  # before a waiter saw it: e.g. a slot refilled before its consumer released it), and
  # detect_races checks the SMEM accesses against the barriers' order.
  x, w = testing.generate(m + k + n, m, k, n)
  params = interpret.InterpretGPUParams(uninitialized_memory="nan", detect_races=True)
  with interpret.force_gpu_interpret_mode(params):
    out = pingpong.matmul(x, w, config=cfg)
    out.block_until_ready()
  assert not interpret_call.get_races().races_found
  helpers.assert_one_bf16_rounding(out, x, w)


# The fused body's ping-pong (Config.pingpong): the two warpgroup tiles of a CTA tile through
# pingpong.Ring in turn, the epilogue and the protocol per warpgroup as in the cooperative body.
MD = config_lib.MatmulDimension


def test_config_pingpong_checks():
  # 5 slots at D = 8 (6 at D = 1: the owner's receive stages take the sixth's SMEM).
  cfg = config_lib.Config(pingpong=True, max_concurrent_steps=5)
  cfg.check_shape(m=2048, n=8192, k_shard=1024, num_devices=8)
  config_lib.Config(pingpong=True, max_concurrent_steps=6).check_shape(
      m=2048, n=8192, k_shard=1024, num_devices=1)
  # A ring slot holds one warpgroup tile's blocks: 32 KB where the CTA tile's are 48 KB.
  assert (config_lib.Config(max_concurrent_steps=5).smem_bytes(8) - cfg.smem_bytes(8)
          == 5 * 128 * 64 * 2)
  for other in (dict(prefetch_tiles=True), dict(spread_stores=True)):
    with pytest.raises(NotImplementedError, match="pingpong"):
      config_lib.Config(pingpong=True, max_concurrent_steps=4, **other).check_shape(
          m=2048, n=8192, k_shard=1024, num_devices=8)
  with pytest.raises(NotImplementedError, match="pairs"):  # 64-row chunks under 128-row tiles
    cfg.check_shape(m=512, n=8192, k_shard=1024, num_devices=8)


@pytest.mark.parametrize("cfg", [
    config_lib.Config(pingpong=True, max_concurrent_steps=5),
    config_lib.Config(tile_m=64, tile_n=256, wg_dimension=MD.M, pingpong=True,
                      max_concurrent_steps=4, tma_add=True, owner_sum="bf16_ring"),
    config_lib.Config(pingpong=True, max_concurrent_steps=4, comm_ctas=8),
])
def test_fused_pingpong_lowers(cfg):
  sds = jax.ShapeDtypeStruct
  d = 2 if cfg.tma_add else 8
  xs, ws = sds((d, 2048, 1024), jnp.bfloat16), sds((d, 1024, 8192), jnp.bfloat16)
  lower = functools.partial(fused.loopback_matmul_reduce_scatter, config=cfg)
  jax.export.export(jax.jit(lower), platforms=["cuda"])(xs, ws)
  if d == 8:  # One rank of the NVLink kernel, without peers.
    alone = functools.partial(fused.rank_alone, num_devices=d, config=cfg, ablate=("comm",))
    jax.export.export(jax.jit(alone), platforms=["cuda"])(sds(xs.shape[1:], jnp.bfloat16),
                                                          sds(ws.shape[1:], jnp.bfloat16))


# 6-10 s each in interpret mode on 2 CPU cores: the slow layer but the first.
@pytest.mark.parametrize("cfg,m,k,n,d,rank", [
    # N split, 3 k blocks on 2 slots (odd phases skipped), 8 tiles on 3 CTAs.
    (config_lib.Config(tile_m=64, tile_n=64, max_concurrent_steps=2, num_sms=3,
                       pingpong=True), 256, 192, 256, 1, 0),
    pytest.param(config_lib.Config(tile_m=64, tile_n=64, wg_dimension=MD.M, num_sms=5,
                                   max_concurrent_steps=3, pingpong=True), 384, 128, 192, 1, 0,
                 marks=pytest.mark.slow),
    # One rank of D = 2 alone: the peer's chunk into its own receive slot, then its own chunk.
    pytest.param(config_lib.Config(tile_m=64, tile_n=64, max_concurrent_steps=2, num_sms=3,
                                   pingpong=True), 256, 256, 256, 2, 1, marks=pytest.mark.slow),
])
def test_fused_pingpong_interpret(cfg, m, k, n, d, rank):
  x, w = testing.generate(m + k + d, m, k, n)
  params = interpret.InterpretGPUParams(uninitialized_memory="nan", detect_races=True)
  with interpret.force_gpu_interpret_mode(params):
    if d == 1:
      out = fused.local_matmul(x, w, config=cfg)
    else:
      out = fused.rank_alone(x, w, num_devices=d, rank=rank, config=cfg,
                             ablate=("comm", "reduce"))
    out.block_until_ready()
  assert not interpret_call.get_races().races_found
  helpers.assert_one_bf16_rounding(out, x, w, slice(rank * m // d, (rank + 1) * m // d))


def test_fused_pingpong_refused_over_nvlink_until_run_there():
  cfg = config_lib.Config(pingpong=True, max_concurrent_steps=5)
  assert "pingpong" in fused.nvlink_unverified(cfg, 8)
  assert fused.nvlink_unverified(cfg, 1) is None
  with pytest.raises(NotImplementedError, match="pingpong"):
    fused.check_supported(m=2048, k_shard=1024, n=8192, dtype=jnp.bfloat16, num_devices=8,
                          config=cfg)
  fused.check_supported(m=2048, k_shard=1024, n=8192, dtype=jnp.bfloat16, num_devices=8,
                        config=cfg, loopback=True)
