"""The SMEM ring of Config.pingpong (Hopper): each compute warpgroup owns whole tiles.

Issue 19's two misses (o_proj at M = 2048 and D = 8's k_shard: 12-16 k blocks a tile) are the
epilogue: in the cooperative body the two compute warpgroups share one CTA tile and one pipeline,
so the tensor cores idle while both store their tile (the stores cost 4.7-7.3%, BUILD_NOTES
2026-12-06). As in CUTLASS's ping-pong kernels, with Config.pingpong the two warpgroups compute
their tiles in turn, and one ring of `stages` SMEM slots carries their k blocks in the CTA's
order, so one warpgroup's epilogue runs under the other's mainloop. The order needs no barrier
of its own: the memory warpgroup fills slot `g % stages` with global k step g once its previous
user released it, so the second warpgroup's blocks arrive as the first's mainloop frees slots.

Barriers: `full[wg, slot]` (TMA bytes landed; one set per consumer, because a waiter tracks
its barrier's phase by counting its own waits, and a consumer skips the other's phases) and
`consumed[slot]` (one arrival: the consumer that read it; the memory warpgroup waits on every
phase). A standalone ping-pong GEMM core with a 2 x 1 cluster's w multicast measured the
design first and went once the fused body matched it (tag `pingpong-probe-v1`, commit 97fc45a;
docs/design.md 3.7).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_rs.kernel import schedule

# The ring's consumers are the fused body's compute warpgroups, each taking whole tiles in turn.
NUM_CONSUMERS = schedule.NUM_COMPUTE_WGS


@dataclasses.dataclass(frozen=True)
class Ring:
  """The SMEM ring of a ping-pong kernel: `stages` slots of x blocks [tile_m, tile_k] and w
  blocks [tile_k, tile_n], `full` [consumers * stages] and `consumed` [stages] barriers. Global
  k step g (the CTA's tiles in order, each tile's blocks in order) uses slot g % stages."""
  x: Any
  w: Any
  full: Any
  consumed: Any
  stages: int

  @staticmethod
  def allocations(tile_m, tile_n, tile_k, stages, dtype, operands):
    """The ring's scoped allocations (pl.run_scoped / scratch), in Ring's field order; `operands`:
    the x and w blocks' SMEM transforms."""
    return (plgpu.SMEM((stages, tile_m, tile_k), dtype, transforms=operands),
            plgpu.SMEM((stages, tile_k, tile_n), dtype, transforms=operands),
            plgpu.Barrier(num_arrivals=2, num_barriers=NUM_CONSUMERS * stages),  # x's and w's
            plgpu.Barrier(num_arrivals=1, num_barriers=stages))

  def load(self, step, consumer, x_src, w_src):
    """The memory warpgroup's step `step` for `consumer`: once the slot's previous user (step
    - stages) has read it, TMA x_src [tile_m, tile_k] and w_src [tile_k, tile_n] into it."""
    slot = step % self.stages
    pl.when(step >= self.stages)(lambda: plgpu.barrier_wait(self.consumed.at[slot]))
    landed = self.full.at[consumer * self.stages + slot]
    plgpu.copy_gmem_to_smem(x_src, self.x.at[slot], landed)
    plgpu.copy_gmem_to_smem(w_src, self.w.at[slot], landed)

  def drain(self, steps):
    """After the memory warpgroup's last of `steps` loads: every slot's last use read before
    the exit (what jax's pipeline does at its end)."""
    for back in range(self.stages, 0, -1):
      pl.when(steps >= back)(lambda back=back: plgpu.barrier_wait(
          self.consumed.at[(steps - back) % self.stages]))

  def mainloop(self, acc, consumer, first, blocks):
    """A consumer's tile: global steps first .. first + blocks - 1 into `acc`, a wgmma in
    flight while the next block's wait runs; a slot is released once the wgmma that read it
    is done."""
    @pl.loop(0, blocks)
    def _block(kk):
      slot = (first + kk) % self.stages
      plgpu.barrier_wait(self.full.at[consumer * self.stages + slot])
      plgpu.wgmma(acc, self.x.at[slot], self.w.at[slot])
      plgpu.wgmma_wait(1)
      pl.when(kk > 0)(lambda: plgpu.barrier_arrive(
          self.consumed.at[(first + kk - 1) % self.stages]))

    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(self.consumed.at[(first + blocks - 1) % self.stages])
