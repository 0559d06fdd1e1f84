"""The kernel body at D = 1 in Mosaic GPU's interpret mode on CPU (no semaphores or remote refs
there, so D > 1 is covered by the schedule simulation, lowering, and the GPU tests), and one
rank's D > 1 program alone (`fused.rank_alone`: its GEMM core, no peers).

Checks the persistent tile loop (CTA striding, snake order) and the epilogue numerically, with
uninitialised memory poisoned to NaN so an unwritten output tile fails.
"""
import pytest

import helpers
from pallas_rs.kernel import config as config_lib
from pallas_rs.kernel import fused
from pallas_rs.bench import testing

interpret = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params")

M = config_lib.MatmulDimension


@pytest.mark.parametrize("cfg,m,k,n", [
    (config_lib.Config(tile_m=64, tile_n=64, max_concurrent_steps=2, num_sms=2), 256, 128, 256),
    # 6-8 s each in interpret mode on 2 CPU cores: the slow layer (tests/conftest.py).
    pytest.param(config_lib.Config(tile_m=128, tile_n=64, max_concurrent_steps=3, num_sms=3),
                 384, 192, 128, marks=pytest.mark.slow),
    # Warpgroups stacked along M (128 x 64 CTA tiles), snake order along M, 9 tiles on 5 CTAs.
    pytest.param(config_lib.Config(tile_m=64, tile_n=64, wg_dimension=M.M, max_concurrent_steps=2,
                                   grid_minor_dim=M.M, grid_tile_width=2, num_sms=5),
                 384, 64, 192, marks=pytest.mark.slow),
    # prefetch_tiles: the memory warpgroup runs on into a CTA's next tile (8 tiles of 64 x 128,
    # 4 blocks each, on 3 CTAs: 3, 3 and 2 tiles), and on 10 CTAs (one tile each, two idle).
    (config_lib.Config(tile_m=64, tile_n=64, max_concurrent_steps=2, num_sms=3,
                       prefetch_tiles=True), 256, 256, 256),
    pytest.param(config_lib.Config(tile_m=64, tile_n=64, max_concurrent_steps=4, num_sms=10,
                                   prefetch_tiles=True), 256, 256, 256, marks=pytest.mark.slow),
    # spread_stores: a tile's 2 sub-tiles leave during the CTA's next tile (4 blocks), the
    # last tile's after the loop (8 tiles on 3 CTAs); 4 sub-tiles over 2 blocks.
    (config_lib.Config(tile_m=64, tile_n=128, max_concurrent_steps=2, num_sms=3,
                       prefetch_tiles=True, spread_stores=True), 256, 256, 512),
    pytest.param(config_lib.Config(tile_m=128, tile_n=128, max_concurrent_steps=2, num_sms=3,
                                   spread_stores=True), 512, 128, 512, marks=pytest.mark.slow),
])
def test_local_matmul_interpret(cfg, m, k, n):
  x, w = testing.generate(m + n, m, k, n)
  params = interpret.InterpretGPUParams(uninitialized_memory="nan")
  with interpret.force_gpu_interpret_mode(params):
    out = fused.local_matmul(x, w, config=cfg)
  helpers.assert_one_bf16_rounding(out, x, w)


# One rank of D alone, the "neither" ablation: its output is its own chunk's partial, x[chunk] @ w,
# written by the D > 1 tile walk (the own chunk last). D = 4 with 64-row chunks under 128-row
# CTA tiles is the pairs walk (a CTA tile over two ranks' chunks; rank 3's own chunk shares a
# tile with rank 2's): along M each warpgroup's tile is one destination's, along N each
# warpgroup's tile has two, one per 64-row half (ranks 0 and 1 give the other half). (n = 256
# there: a grid one CTA tile wide crashes the CPU interpreter in jax's planar_snake, whose
# unused partial-band branch takes a remainder by zero.)
# Last, Config.spread_stores at D = 2: each tile's stores (the own chunk's into the output, the
# peer's into this rank's receive slot) leave during the CTA's next tile (8 tiles on 3 CTAs, 4
# blocks each), the last one's at once.
@pytest.mark.parametrize("d,rank,n,k,cfg", [
    (4, 3, 128, 64, config_lib.Config(tile_m=64, tile_n=64, wg_dimension=M.M,
                                      max_concurrent_steps=2, num_sms=3)),
    (4, 3, 256, 64, config_lib.Config(tile_m=128, tile_n=64, max_concurrent_steps=2, num_sms=3)),
    # Rank 0 (no shared tile) and D = 2: ~6-12 s each in interpret mode on 2 CPU cores, the
    # slow layer (tests/conftest.py).
    pytest.param(4, 0, 256, 64, config_lib.Config(tile_m=128, tile_n=64, max_concurrent_steps=2,
                                                  num_sms=2), marks=pytest.mark.slow),
    pytest.param(2, 1, 128, 64, config_lib.Config(tile_m=64, tile_n=64, max_concurrent_steps=2,
                                                  num_sms=3), marks=pytest.mark.slow),
    (2, 1, 256, 256, config_lib.Config(tile_m=64, tile_n=64, max_concurrent_steps=2, num_sms=3,
                                       spread_stores=True)),
])
def test_rank_alone_gemm_core_interpret(d, rank, n, k, cfg):
  m = 256
  cfg.check_shape(m=m, n=n, k_shard=k, num_devices=d)
  x, w = testing.generate(rank + 10 * d, m, k, n)
  assert cfg.chunk_group(m, d) == (2 if d == 4 else 1)
  params = interpret.InterpretGPUParams(uninitialized_memory="nan")
  with interpret.force_gpu_interpret_mode(params):
    out = fused.rank_alone(x, w, num_devices=d, rank=rank, config=cfg, ablate=("comm", "reduce"))
  helpers.assert_one_bf16_rounding(out, x, w, slice(rank * m // d, (rank + 1) * m // d))
