"""The comm CTAs of kernel v3 (docs/design.md section 3.2): the few CTAs per rank that move
the staged partial tiles while the compute CTAs run the GEMM and never touch NVLink.

`push_program`: the source's comm CTAs copy its staged tiles into the owners' receive slots.
`pull_program`: the owner's comm CTAs TMA-load the sources' staged tiles into their own receive
slots (no remote store on their SMs; needs remote TMA loads, fused.REMOTE_TMA_LOAD_JAX).
Both move one comm copy (config.comm_rows rows of a warpgroup's half tile, <= 32 KB) at a time
through SMEM and announce landed tiles on the owner's per-(slot, comm CTA) counters
(schedule.SemLayout); both are simulated as data by simulator.simulate.
"""
from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax
import jax.numpy as jnp

from pallas_rs.kernel import schedule
from pallas_rs.kernel.rank import Rank

_NUM_COMPUTE_WGS = schedule.NUM_COMPUTE_WGS


def _walk(k: Rank, comm_index, wg_idx):
  """(num_tiles, tile_of, block) of comm CTA `comm_index`'s warpgroup `wg_idx`: it moves tiles
  tile_of(q) = comm_index + q * num_comm, q < num_tiles, of each step, and copy j is rows
  block(j) = (rows, cols) of tile j // blocks within a [chunk, n] array."""
  rows = k.config.comm_rows
  blocks = k.config.tile_m // rows
  num_tiles = jnp.maximum(k.tiles - comm_index + k.num_comm - 1, 0) // k.num_comm
  tile_of = lambda q: comm_index + q * k.num_comm

  def block(j):
    rs, cs = k.tile_slices(tile_of(j // blocks), wg_idx)[1]
    return pl.ds(rs.start + lax.rem(j, blocks) * rows, rows), cs

  return num_tiles, tile_of, block


def _announce_landed(k: Rank, j, blocks: int, emit):
  """After copy j (of tile j // blocks) is issued: once COMM_SIGNAL_BATCH more tiles are known
  to have landed, emit(COMM_SIGNAL_BATCH) announces them. At most COMM_SIGNAL_LAG later tiles'
  stores are pending, so tiles up to j // blocks - LAG have landed. One signal per batch, not
  per tile: each costs ~0.7 us of the comm CTA's time (its fence waits for the stores before
  it), as long as a 32 KB copy at the link's per-SM rate (measured, BUILD_NOTES 2026-12-01)."""
  lag, batch = schedule.COMM_SIGNAL_LAG, schedule.COMM_SIGNAL_BATCH
  landed = j // blocks - lag + 1

  @pl.when((lax.rem(j, blocks) == blocks - 1) & (landed > 0) & (lax.rem(landed, batch) == 0)
           & k.hooks.comm_signal)
  def _():
    plgpu.wait_smem_to_gmem(lag * blocks, wait_read_only=False)
    emit(batch)


def _announce_rest(k: Rank, num_tiles, emit):
  """After the last copy of a step: waits for every store (so the next step's TMA adds onto
  the same tiles come after them, tma_add), then announces the tiles that _announce_landed
  left (1 to LAG + BATCH - 1 of them; a signal's increment is static)."""
  lag, batch = schedule.COMM_SIGNAL_LAG, schedule.COMM_SIGNAL_BATCH
  plgpu.wait_smem_to_gmem(0, wait_read_only=False)
  rest = num_tiles - jnp.maximum(num_tiles - lag, 0) // batch * batch
  for r in range(1, lag + batch):
    @pl.when((rest == r) & k.hooks.comm_signal)
    def _(r=r):
      emit(r)


def push_program(k: Rank, comm_index):
  """Comm CTA `comm_index` of `num_comm` (kernel v3, docs/design.md section 3.2): for each
  peer in schedule order, pushes the staged tiles comm_index, +num_comm, ... to the owner's
  receive slot and signals the owner once they have landed. Warpgroup w moves compute
  warpgroup w's half tile in row blocks of `comm_rows`: registers <- local staging (LSU
  loads), -> one of `sets` SMEM buffers -> the owner (TMA store). The reads are LSU loads, not
  TMA loads, because an SM's TMA load waits until its own earlier remote TMA stores have
  drained (section 3.2); measured, that did not make a comm CTA faster (~24 GB/s either way)."""
  config, d = k.config, k.d
  rank, transport, sems, where = k.rank, k.transport, k.sems, k.where
  rows, tile_n, stage_wait = config.comm_rows, config.tile_n, k.hooks.stage_wait
  blocks = config.tile_m // rows
  sets = config.comm_buffer_sets
  comm_scoped = dict(buf=plgpu.SMEM((_NUM_COMPUTE_WGS, sets, rows, tile_n), k.part_dtype))

  @functools.partial(pl.run_scoped, collective_axes="wg", **comm_scoped)
  def _scope(buf):
    wg_idx = lax.axis_index("wg")

    @pl.when(wg_idx < _NUM_COMPUTE_WGS)
    def _pusher():
      num_tiles, tile_of, block = _walk(k, comm_index, wg_idx)
      for step in range(d - 1):  # Static peers: see transport.py.
        o, src = schedule.dst_offset(step, d), k.stage_local.at[step]
        slot = schedule.recv_slot(o)
        if k.sum_in_output:  # The owner TMA-adds its own partial onto it (D = 2).
          dst = transport.peer(k.out_all, rank, o)
        else:
          dst = transport.peer(k.recv_gmem, rank, o).at[slot]

        def emit(inc, o=o, slot=slot):
          transport.signal(sems, rank, o, where.delivered(slot, comm_index, wg_idx), inc)

        def push(j, carry, step=step, src=src, dst=dst, emit=emit):
          q = j // blocks

          @pl.when((lax.rem(j, blocks) == 0) & stage_wait)
          def _():
            transport.wait(sems, rank, where.staged(step, tile_of(q), wg_idx), 1, local=True)
          part = src.at[block(j)][...]
          b = lax.rem(j, sets)
          # Buffer b last held block j - sets: its store must have read it.
          plgpu.wait_smem_to_gmem(schedule.comm_reuse_wait(sets), wait_read_only=True)
          buf[wg_idx, b] = part
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(buf.at[wg_idx, b], dst.at[block(j)])

          _announce_landed(k, j, blocks, emit)
          return carry

        with jax.named_scope(f"comm_push_step{step}"):  # (profile: one event pair a step)
          lax.fori_loop(0, num_tiles * blocks, push, None)
          _announce_rest(k, num_tiles, emit)


def pull_program(k: Rank, comm_index):
  """Comm CTA `comm_index` of `num_comm` for this rank as owner (kernel v3 pull, docs/design.md
  section 3.2): for each remote step s in order (the peer at offset s + 1 computes this rank's
  chunk at its step s: ring order), TMA-loads that peer's staged partials of tiles comm_index,
  +num_comm, ... over NVLink and TMA-stores them into the local receive slot of that peer,
  `prefetch` blocks of loads in flight per warpgroup; with tma_add, stores step 0's and TMA-adds
  every later step's onto it instead, in ring order (section 3.5): into the output (bf16: the
  unfused path's adds, the owner's epilogue only adds its own partial) or, fp32 partials, into
  receive slot 0 (the owner loads one partial instead of D - 1). Announces landed
  tiles to the own compute CTAs in batches (as push does); then tells every peer it is done
  reading the peer's staging buffer, and comm CTA 0 waits until every peer is done with
  this rank's. No remote store is ever issued here, so no load queues behind one (the
  head-of-line effect, section 3.2)."""
  config, d, num_comm = k.config, k.d, k.num_comm
  rank, transport, sems, where = k.rank, k.transport, k.sems, k.where
  rows, tile_n, stage_wait = config.comm_rows, config.tile_n, k.hooks.stage_wait
  blocks = config.tile_m // rows
  sets = config.comm_buffer_sets
  prefetch, reuse_wait = schedule.comm_prefetch(sets)
  comm_scoped = dict(
      buf=plgpu.SMEM((_NUM_COMPUTE_WGS, sets, rows, tile_n), k.part_dtype),
      barrier=plgpu.Barrier(num_barriers=_NUM_COMPUTE_WGS * sets),
  )

  @functools.partial(pl.run_scoped, collective_axes="wg", **comm_scoped)
  def _scope(buf, barrier):
    wg_idx = lax.axis_index("wg")

    @pl.when(wg_idx < _NUM_COMPUTE_WGS)
    def _puller():
      num_tiles, tile_of, block = _walk(k, comm_index, wg_idx)
      count = num_tiles * blocks

      for step in range(d - 1):  # Static peers: see transport.py.
        o = schedule.source_offset(step)
        src = transport.peer(k.stage_gmem, rank, o).at[step]
        slot = schedule.arrival_slot(step, d)
        dst = (k.out if k.sum_in_output
               else k.recv_local.at[0 if k.sum_slot else slot])
        # Ring order is step order: each step's adds are issued after the previous step's
        # writes have completed (_announce_rest waits for them; a wait covers only this
        # warpgroup's copies, which suffices: the same warpgroup moves a tile's rows in every
        # step, _walk), so the sum's order is fixed.
        reduction = "add" if config.tma_add and step > 0 else None

        def load(j, step=step, src=src):
          @pl.when((lax.rem(j, blocks) == 0) & stage_wait)
          def _():
            transport.wait(sems, rank, where.staged(step, tile_of(j // blocks), wg_idx), 1)
          b = lax.rem(j, sets)
          plgpu.copy_gmem_to_smem(src.at[block(j)], buf.at[wg_idx, b],
                                  barrier.at[wg_idx * sets + b])

        for i in range(prefetch):
          @pl.when(i < count)
          def _(i=i, load=load):
            load(i)

        def emit(inc, slot=slot):
          transport.signal_local(sems, rank, where.delivered(slot, comm_index, wg_idx), inc)

        def move(j, carry, dst=dst, load=load, emit=emit, reduction=reduction):
          b = lax.rem(j, sets)
          plgpu.barrier_wait(barrier.at[wg_idx * sets + b])
          if k.hooks.recv_store:
            plgpu.copy_smem_to_gmem(buf.at[wg_idx, b], dst.at[block(j)],
                                    reduction_op=reduction)
          else:
            plgpu.commit_smem()  # (timing only) the buffer is refilled without being stored

          @pl.when(j + prefetch < count)
          def _():
            # Buffer (j + prefetch) % sets last held block j + prefetch - sets; the stores
            # issued after it may still read SMEM, it may not (schedule.comm_prefetch).
            plgpu.wait_smem_to_gmem(reuse_wait, wait_read_only=True)
            load(j + prefetch)

          _announce_landed(k, j, blocks, emit)
          return carry

        with jax.named_scope(f"comm_pull_step{step}"):  # (profile: one event pair a step)
          lax.fori_loop(0, count, move, None)
          _announce_rest(k, num_tiles, emit)

      # Each load was waited on before its store: this warpgroup reads no peer any more.
      for o in range(1, d):
        transport.signal(sems, rank, o, where.done())

      @pl.when((comm_index == 0) & (wg_idx == 0))
      @jax.named_scope("comm_exit_wait")
      def _():
        # Peers may still read this rank's staging buffer; XLA may reuse it once the kernel
        # exits.
        transport.wait(sems, rank, where.done(), schedule.pull_done_target(d, num_comm))
