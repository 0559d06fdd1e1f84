"""A ping-pong GEMM core (Hopper, one GPU): out [m, n] = x [m, k] @ w [k, n], bf16 in and out.

Issue 19's two misses (o_proj at M = 2048 and D = 8's k_shard: 12-16 k blocks a tile) are the
epilogue: body.py's two compute warpgroups share one CTA tile and one pipeline, so the tensor
cores idle while both store their tile (the stores cost 4.7-7.3%, BUILD_NOTES 2026-12-06). Here,
as in CUTLASS's ping-pong kernels, each compute warpgroup owns whole tiles: warpgroup 0 takes
the CTA's tiles 0, 2, 4, ..., warpgroup 1 tiles 1, 3, 5, ..., and one ring of `stages` SMEM
slots carries their k blocks in the CTA's tile order, so one warpgroup's epilogue runs under the
other's mainloop. The order needs no barrier of its own: the memory warpgroup fills slot
`g % stages` with global k step g = local tile * blocks + block once its previous user
released it, so the second warpgroup's blocks arrive as the first's mainloop frees slots.

Barriers: `full[wg, slot]` (TMA bytes landed; one set per consumer, because a waiter tracks
its barrier's phase by counting its own waits, and a consumer skips the other's phases) and
`consumed[slot]` (one arrival: the consumer that read it; the memory warpgroup waits on every
phase). With `cluster_m` = 2 two CTAs (a cluster) take vertically adjacent tiles in lockstep
and load each w block once, multicast into both (cluster TMA multicast: SM to SM on one GPU,
not NVLink multicast), as cuBLAS's 2 x 1 clusters do: what the cooperative kernel's shared w
block saved, back. `consumed` is then a cluster barrier: a slot is refilled once both CTAs'
consumers read it. The kernel here is the standalone GEMM core (D = 1, no communication:
experiments/gemm_core.py's `--pingpong`); `Ring` is also the fused body's with Config.pingpong.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_rs.kernel import config as config_lib

MatmulDimension = config_lib.MatmulDimension
NUM_CONSUMERS = 2
# Registers a thread of the memory / compute warpgroups (jax's pipeline's split for memory 40).
MEMORY_REGISTERS = 40
CONSUMER_REGISTERS = 232
# What the accumulator may take of a consumer's registers: 128 fp32 a thread (CUTLASS's
# ping-pong tiles, 128 x 128 and 64 x 256), the rest for addresses and the epilogue's cast.
_MAX_ACC_ELEMENTS = 128 * 128
SMEM_BYTES = config_lib.SMEM_LIMIT_BYTES


def swizzled(block_minor_elems: int, dtype) -> tuple:
  """The TMA transforms of an SMEM block whose minor dimension has `block_minor_elems`."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(block_minor_elems * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


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
  def allocations(tile_m, tile_n, tile_k, stages, dtype, swizzle_cols, cluster: bool = False):
    """The ring's scoped allocations (pl.run_scoped / scratch), in Ring's field order."""
    operands = swizzled(swizzle_cols, dtype)
    consumed = (plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=1,
                                     num_barriers=stages) if cluster else
                plgpu.Barrier(num_arrivals=1, num_barriers=stages))
    return (plgpu.SMEM((stages, tile_m, tile_k), dtype, transforms=operands),
            plgpu.SMEM((stages, tile_k, tile_n), dtype, transforms=operands),
            plgpu.Barrier(num_arrivals=2, num_barriers=NUM_CONSUMERS * stages),  # x's and w's
            consumed)

  def load(self, step, consumer, x_src, w_src, **w_copy):
    """The memory warpgroup's step `step` for `consumer`: once the slot's previous user (step
    - stages) has read it, TMA x_src [tile_m, tile_k] and w_src [tile_k, tile_n] into it."""
    slot = step % self.stages
    pl.when(step >= self.stages)(lambda: plgpu.barrier_wait(self.consumed.at[slot]))
    landed = self.full.at[consumer * self.stages + slot]
    plgpu.copy_gmem_to_smem(x_src, self.x.at[slot], landed)
    plgpu.copy_gmem_to_smem(w_src, self.w.at[slot], landed, **w_copy)

  def drain(self, steps):
    """After the memory warpgroup's last of `steps` loads: every slot's last use read before
    the exit (what jax's pipeline does at its end; a cluster's peer still writes into it)."""
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


@dataclasses.dataclass(frozen=True)
class PingPongConfig:
  """A ping-pong kernel: each consumer warpgroup's tile is tile_m x tile_n.

  Attributes:
    tile_m: rows of a tile, 64 or 128 (one or two wgmma row blocks).
    tile_n: columns of a tile, a multiple of 64, at most 256 (tile_m * tile_n <= 128 * 128).
    tile_k: k block of a pipeline slot (64: the 128-byte swizzle of bf16).
    stages: SMEM slots of the ring (x and w blocks), shared by the two consumers.
    epi_tile_m, epi_tile_n: a TMA store's sub-tile; two SMEM slots of it per consumer.
    grid_minor_dim, grid_tile_width: tile order (`plgpu.planar_snake`) of the clusters' tiles.
    cluster_m: CTAs of a cluster, on vertically adjacent tiles, sharing w's blocks (1 or 2).
    num_sms: CTAs of the persistent grid.
  """
  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 6
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  grid_minor_dim: MatmulDimension = MatmulDimension.N
  grid_tile_width: int = 1
  cluster_m: int = 1
  num_sms: int = config_lib.DEFAULT_NUM_SMS

  def __post_init__(self):
    if self.tile_m not in (64, 128):
      raise ValueError(f"tile_m={self.tile_m} must be 64 or 128")
    if self.tile_n % 64 or not 64 <= self.tile_n <= 256:
      raise ValueError(f"tile_n={self.tile_n} must be a multiple of 64 in [64, 256]")
    if self.tile_m * self.tile_n > _MAX_ACC_ELEMENTS:
      raise ValueError(f"a {self.tile_m} x {self.tile_n} fp32 accumulator exceeds a warpgroup's "
                       f"{_MAX_ACC_ELEMENTS // 128} registers a thread for it")
    if self.tile_k != 64:
      raise ValueError(f"tile_k={self.tile_k} must be 64 (bf16's 128-byte swizzle)")
    if self.stages < 2:
      raise ValueError(f"stages={self.stages} must be >= 2")
    if self.tile_m % self.epi_tile_m or self.tile_n % self.epi_tile_n or self.epi_tile_n % 32:
      raise ValueError(f"epilogue sub-tile {self.epi_tile_m} x {self.epi_tile_n} must divide the "
                       f"tile {self.tile_m} x {self.tile_n} (columns a multiple of 32)")
    if self.cluster_m not in (1, 2):
      raise ValueError(f"cluster_m={self.cluster_m} must be 1 or 2")
    if self.num_sms % self.cluster_m:
      raise ValueError(f"num_sms={self.num_sms} must be a multiple of cluster_m={self.cluster_m}")
    if self.grid_tile_width < 1 or self.num_sms < 1:
      raise ValueError(f"grid_tile_width={self.grid_tile_width} and num_sms={self.num_sms} "
                       "must be >= 1")

  def smem_bytes(self, itemsize: int = 2) -> int:
    """The ring's slots and the consumers' store slots (barriers aside)."""
    ring = self.stages * (self.tile_m + self.tile_n) * self.tile_k
    out = NUM_CONSUMERS * 2 * self.epi_tile_m * self.epi_tile_n
    return (ring + out) * itemsize

  def check_shape(self, *, m: int, n: int, k: int) -> None:
    """ValueError for a GEMM these tiles do not divide, or a config over the SMEM."""
    rows = self.tile_m * self.cluster_m
    if m % rows or n % self.tile_n or k % self.tile_k:
      raise ValueError(f"x [{m}, {k}] @ w [{k}, {n}]: m, n, k must be multiples of the "
                       f"cluster's tile {rows} x {self.tile_n} x {self.tile_k}")
    if self.smem_bytes() > SMEM_BYTES:
      raise ValueError(f"{self.stages} stages of {self.tile_m} x {self.tile_n} tiles take "
                       f"{self.smem_bytes()} B of SMEM, over {SMEM_BYTES}")


def _kernel(x_gmem, w_gmem, out_gmem, x_smem, w_smem, full, consumed, out_smem, *,
            config: PingPongConfig):
  c = config
  ring = Ring(x_smem, w_smem, full, consumed, c.stages)
  m, k = x_gmem.shape
  n = w_gmem.shape[1]
  grid = (m // (c.tile_m * c.cluster_m), n // c.tile_n)  # The clusters' tiles.
  blocks = k // c.tile_k
  cluster, num_clusters = lax.axis_index("cluster_grid"), lax.axis_size("cluster_grid")
  wg = lax.axis_index("wg")
  count = jnp.maximum(grid[0] * grid[1] - cluster + num_clusters - 1, 0) // num_clusters
  shared_w = {} if c.cluster_m == 1 else dict(collective_axes="cluster")

  def tile_origin(local):
    """(row, column) of the CTA's `local`-th tile."""
    m_idx, n_idx = plgpu.planar_snake(cluster + local * num_clusters, grid, c.grid_minor_dim,
                                      c.grid_tile_width)
    if c.cluster_m > 1:
      m_idx = m_idx * c.cluster_m + lax.axis_index("cluster")
    return m_idx * c.tile_m, n_idx * c.tile_n

  @pl.when(wg == NUM_CONSUMERS)
  def _memory():
    plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

    @pl.loop(0, count)
    def _tile(local):
      row, col = tile_origin(local)

      @pl.loop(0, blocks)
      def _block(kk):
        ks = pl.ds(kk * c.tile_k, c.tile_k)
        ring.load(local * blocks + kk, local % NUM_CONSUMERS, x_gmem.at[pl.ds(row, c.tile_m), ks],
                  w_gmem.at[ks, pl.ds(col, c.tile_n)], **shared_w)

    ring.drain(count * blocks)

  @pl.when(wg < NUM_CONSUMERS)
  def _consume():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")

    @pl.loop(0, (count - wg + NUM_CONSUMERS - 1) // NUM_CONSUMERS)
    def _tile(i):
      local = wg + i * NUM_CONSUMERS
      row, col = tile_origin(local)

      @functools.partial(pl.run_scoped, acc=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
      def _(acc):
        ring.mainloop(acc, wg, local * blocks, blocks)
        _epilogue(c, acc[...].astype(out_gmem.dtype), out_smem.at[wg],
                  out_gmem.at[pl.ds(row, c.tile_m), pl.ds(col, c.tile_n)])

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _epilogue(c: PingPongConfig, tile, slots, out_tile):
  """The tile's TMA stores, sub-tile by sub-tile through the consumer's two SMEM slots; the
  last ones are awaited only when their slot comes round again (next tile) or at exit."""
  cols = c.tile_n // c.epi_tile_n
  for i in range(c.tile_m // c.epi_tile_m * cols):
    rows = slice((i // cols) * c.epi_tile_m, (i // cols + 1) * c.epi_tile_m)
    sub_cols = slice((i % cols) * c.epi_tile_n, (i % cols + 1) * c.epi_tile_n)
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # The slot's previous store has read it.
    slots[i % 2] = tile[rows, sub_cols]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(slots.at[i % 2], out_tile.at[rows, sub_cols])


def matmul(x, w, *, config: PingPongConfig | None = None) -> jax.Array:
  """x [m, k] @ w [k, n] -> [m, n] (bf16, fp32 accumulation) with the ping-pong kernel."""
  c = config or PingPongConfig()
  (m, k), (k2, n) = x.shape, w.shape
  if k != k2 or x.dtype != w.dtype or jnp.dtype(x.dtype) != jnp.bfloat16:
    raise ValueError(f"x {x.shape} {x.dtype} @ w {w.shape} {w.dtype}: bf16 [m, k] @ [k, n]")
  c.check_shape(m=m, n=n, k=k)
  scratch = [
      *Ring.allocations(c.tile_m, c.tile_n, c.tile_k, c.stages, x.dtype, c.tile_k,
                        cluster=c.cluster_m > 1),
      plgpu.SMEM((NUM_CONSUMERS, 2, c.epi_tile_m, c.epi_tile_n), x.dtype,
                 transforms=swizzled(c.epi_tile_n, x.dtype)),
  ]
  f = plgpu.kernel(
      functools.partial(_kernel, config=c),
      out_type=jax.ShapeDtypeStruct((m, n), x.dtype),
      scratch_types=scratch,
      grid=(c.num_sms // c.cluster_m,),
      grid_names=("cluster_grid",),
      cluster=(c.cluster_m,),
      cluster_names=("cluster",),
      num_threads=NUM_CONSUMERS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      kernel_name="pallas_rs_pingpong_matmul",
  )
  return f(x, w)
