"""The fused kernels: this package's matmul + reduce-scatter (Mosaic GPU, Hopper) and the
wrapper of jax's all-gather matmul.

  config.py     Config (tiling, SMEM estimate), default heuristic, search space
  schedule.py   tile/destination schedule (simulator.py runs it as data for the tests)
  transport.py  NVLink (peer) and loopback (one GPU) transports
  rank.py       one rank's kernel as data: the timing hooks and the facts of a call
  comm.py       kernel v3's comm CTAs (push or pull of the staged partials)
  epilogue.py   a compute warpgroup's epilogue phases (push or stage, owner's wait and sum)
  body.py       the kernel body: comm and compute CTAs, the tile loop and its mainloop
  fused.py      its entry points: check_supported, CheckedConfig, shard_map, loopback, local
  ag_matmul.py  jax's all-gather matmul: support check, call, config <-> JSON

Nothing here decides which path runs (`pallas_rs.tuning.gate` does) or imports from above.
"""
