"""The fused body's ping-pong (Config.pingpong, pallas_rs.kernel.pingpong's ring): its config's
checks, its lowering for CUDA, and its numerics in Mosaic GPU's interpret mode on CPU (every
output element against an fp64 product, uninitialised memory poisoned to NaN, races checked)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import helpers
from pallas_rs.bench import testing
from pallas_rs.kernel import config as config_lib
from pallas_rs.kernel import fused

interpret = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params")
interpret_call = pytest.importorskip(
    "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")


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
  # At D = 1 as the GEMM core measured on one H100 (BUILD_NOTES 2026-12-07): 6 slots where they
  # fit, row bands of 8 tiles; Mixtral o_proj at M = 2048, D = 8's k_shard.
  local = functools.partial(fused.local_matmul, config=config_lib.fit_smem(dataclasses.replace(
      cfg, max_concurrent_steps=6, grid_minor_dim=MD.M, grid_tile_width=8), 1))
  jax.export.export(jax.jit(local), platforms=["cuda"])(sds((2048, 768), jnp.bfloat16),
                                                        sds((768, 6144), jnp.bfloat16))
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
    # Two-row-block wgmma tiles (128 x 128 a warpgroup), 4 CTA tiles on 3 CTAs (one takes two),
    # 4 k blocks on 3 slots; the snake along M, two tiles wide (the measured tile order).
    pytest.param(config_lib.Config(tile_m=128, tile_n=128, max_concurrent_steps=3, num_sms=3,
                                   grid_minor_dim=MD.M, grid_tile_width=2, pingpong=True),
                 256, 256, 512, 1, 0, marks=pytest.mark.slow),
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
