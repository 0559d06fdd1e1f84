"""The fused kernels: this package's matmul + reduce-scatter (Mosaic GPU, Hopper) and the
wrapper of jax's all-gather matmul.

  config.py     Config (tiling, SMEM estimate), default heuristic, search space
  schedule.py   tile/destination schedule, also as data for tests
  transport.py  NVLink (peer) and loopback (one GPU) transports
  comm.py       kernel v3's comm CTAs (push or pull of the staged partials)
  body.py       the kernel body (GEMM, epilogues, owner's sum)
  fused.py      its entry points: check_supported, CheckedConfig, shard_map, loopback, local
  ag_matmul.py  jax's all-gather matmul: support check, call, config <-> JSON

Nothing here decides which path runs (`pallas_rs.tuning.gate` does) or imports from above.
"""
