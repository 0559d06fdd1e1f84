"""The fused matmul + reduce-scatter Mosaic GPU kernel body (Hopper).

A fork of jax's `hopper_matmul_mgpu.kernel` (same pipeline, tiling and warp specialisation:
two compute warpgroups split the CTA tile along N, one memory warpgroup issues TMA loads) whose
persistent tile loop walks all `num_devices` row chunks in the staggered order of schedule.py
and whose epilogue either pushes the tile to its owner or reduces the received partials.
Communication goes through a transport (transport.py), so the same body runs on real devices
(NVLink) and as virtual ranks on one GPU (loopback).
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_rs import schedule
from pallas_rs.config import Config

_NUM_COMPUTE_WGS = schedule.NUM_COMPUTE_WGS


def _swizzled(block_minor_elems: int, dtype) -> tuple:
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(block_minor_elems * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


ABLATIONS = frozenset({"comm", "reduce"})


def kernel_body(x_gmem, w_gmem, out_gmem, recv_gmem, *, config: Config, num_devices: int,
                transport, skip: frozenset[str] = frozenset()):
  """One rank's program.

  Per rank (transport.bind selects it): x [m, k_shard], w [k_shard, n], out [m // D, n],
  recv [D - 1, m // D, n] (this rank's receive slots; None when D == 1).

  `skip` leaves stages out, for timing only (the output is then wrong): "comm" stores peer
  tiles into this rank's own receive slots instead of the peer's and drops signals and waits
  (same local traffic, no NVLink, no synchronisation); "reduce" keeps the waits but not the
  loads and adds of the received partials.
  """
  assert skip <= ABLATIONS, skip
  d = num_devices
  rank = transport.rank()
  x_gmem, w_gmem, out_gmem, recv_local = transport.bind(x_gmem, w_gmem, out_gmem, recv_gmem, rank)
  dtype, out_dtype = x_gmem.dtype, out_gmem.dtype
  m, k_shard = x_gmem.shape
  n = w_gmem.shape[1]
  chunk = m // d
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  cta_tile_m, cta_tile_n = config.cta_tile_m, config.cta_tile_n
  epi_m, epi_n = config.epi_tile_m, config.epi_tile_n
  m_iters, n_iters = chunk // cta_tile_m, n // cta_tile_n
  tiles = m_iters * n_iters
  k_iters = k_shard // tile_k
  num_out_slots = config.num_out_slots
  recv_stages = config.recv_stages
  in_transforms = _swizzled(tile_k, dtype)
  epi_transforms = _swizzled(epi_n, out_dtype)
  sems = transport.semaphores(tiles) if d > 1 else None
  first_eager = schedule.first_eager_step(d, config.eager_signal_steps)

  def get_pipeline(pipeline_body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        pipeline_body,
        grid=(k_iters,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((cta_tile_m, tile_k), lambda k: (0, k),
                            transforms=in_transforms, memory_space=plgpu.SMEM),
            plgpu.BlockSpec((tile_k, cta_tile_n), lambda k: (k, 0),
                            transforms=in_transforms, memory_space=plgpu.SMEM),
        ],
        wg_axis="wg",
        num_compute_wgs=_NUM_COMPUTE_WGS,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context,
    )

  ignore = lambda *_, **__: None
  scoped = dict(
      pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
      out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, num_out_slots, epi_m, epi_n), out_dtype,
                          transforms=epi_transforms),
  )
  if d > 1:
    scoped["part_smem"] = plgpu.SMEM((_NUM_COMPUTE_WGS, recv_stages, epi_m, epi_n), out_dtype,
                                     transforms=epi_transforms)
    scoped["part_barrier"] = plgpu.Barrier(num_barriers=_NUM_COMPUTE_WGS * recv_stages)

  @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
  def _scope(pipeline_allocs, out_smem, part_smem=None, part_barrier=None):
    wg_idx = lax.axis_index("wg")
    num_ctas = lax.axis_size("cluster_grid")
    epi_tiles = [(mi, ni) for mi in range(tile_m // epi_m) for ni in range(tile_n // epi_n)]

    def epi_slices(mi, ni):
      return slice(mi * epi_m, (mi + 1) * epi_m), slice(ni * epi_n, (ni + 1) * epi_n)

    def signal_tile(lin_idx):
      """Announces the remote tile `lin_idx` of this warpgroup (its stores have landed)."""
      step, tile = schedule.step_and_tile(lin_idx, tiles)
      offset = schedule.dst_offset(step, d)
      for o in range(1, d):  # Static peers: see transport.py.
        @pl.when(offset == o)
        def _():
          transport.signal(sems, rank, o, tile, wg_idx)

    def store_tile(subs, dst_ref):
      """Epilogue sub-tiles `subs` (out_dtype, in epi_tiles order) -> dst_ref [tile_m, tile_n]
      through the double-buffered SMEM slots."""
      for i, (mi, ni) in enumerate(epi_tiles):
        slot = i % num_out_slots
        plgpu.wait_smem_to_gmem(num_out_slots - 1, wait_read_only=True)
        out_smem[wg_idx, slot] = subs[i]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg_idx, slot], dst_ref.at[epi_slices(mi, ni)])

    def reduce_tile(acc, tile, slices):
      """acc (f32) + received partials in slot order, rounded once, -> own output tile."""
      if "comm" not in skip:
        transport.wait(sems, rank, tile, wg_idx, d - 1)
      loads = [(mi, ni, j) for mi, ni in epi_tiles for j in range(d - 1)]
      if "reduce" in skip:
        loads = []

      def issue(i):
        mi, ni, j = loads[i]
        sm, sn = epi_slices(mi, ni)
        buf = i % recv_stages
        plgpu.copy_gmem_to_smem(
            recv_local.at[j].at[slices].at[sm, sn],
            part_smem.at[wg_idx, buf],
            part_barrier.at[wg_idx * recv_stages + buf])

      for i in range(min(recv_stages, len(loads))):
        issue(i)
      i = 0
      summed = []
      for mi, ni in epi_tiles:
        sm, sn = epi_slices(mi, ni)
        sub = acc[sm, sn]
        for _ in range(len(loads) // len(epi_tiles)):
          buf = i % recv_stages
          plgpu.barrier_wait(part_barrier.at[wg_idx * recv_stages + buf])
          sub = sub + part_smem[wg_idx, buf].astype(jnp.float32)
          if i + recv_stages < len(loads):
            plgpu.commit_smem()  # Every thread has read `buf` before TMA overwrites it.
            issue(i + recv_stages)
          i += 1
        summed.append(sub.astype(out_dtype))
      return summed

    @plgpu.nd_loop((d * tiles,), collective_axes="cluster_grid")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      (lin_idx,) = loop_info.index
      step, tile = schedule.step_and_tile(lin_idx, tiles)
      offset = schedule.dst_offset(step, d)
      dst = lax.rem(rank + offset, d)
      m_idx, n_idx = plgpu.planar_snake(tile, (m_iters, n_iters), config.grid_minor_dim,
                                        config.grid_tile_width)
      row0 = m_idx * cta_tile_m
      cta_n_slice = pl.ds(n_idx * cta_tile_n, cta_tile_n)
      wg_n_slice = pl.ds(wg_idx * tile_n, tile_n)
      # Rows and columns of this warpgroup's part of the tile, within a [chunk, n] array.
      slices = (pl.ds(row0, tile_m), pl.ds(n_idx * cta_tile_n + wg_idx * tile_n, tile_n))

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          eval_pipeline(acc_ref)
          # The previous tile's stores had this tile's whole mainloop to land.
          plgpu.wait_smem_to_gmem(0, wait_read_only=False)
          if d > 1 and "comm" not in skip:
            is_deferred_prev = (loop_info.local_index > 0) & (
                (lin_idx - num_ctas) // tiles < first_eager)
            @pl.when(is_deferred_prev)
            def _():
              signal_tile(lin_idx - num_ctas)

          is_own = step == schedule.own_step(d)

          @pl.when(is_own)
          def _own():
            if d > 1:
              summed = reduce_tile(acc_ref[...], tile, slices)
            else:
              acc = acc_ref[...].astype(out_dtype)
              summed = [acc[epi_slices(mi, ni)] for mi, ni in epi_tiles]
            store_tile(summed, out_gmem.at[slices])

          if d > 1:
            @pl.when(jnp.logical_not(is_own))
            def _remote():
              acc = acc_ref[...].astype(out_dtype)
              subs = [acc[epi_slices(mi, ni)] for mi, ni in epi_tiles]
              for o in range(1, d):
                @pl.when(offset == o)
                def _():
                  if "comm" in skip:
                    dst_recv = recv_local
                  else:
                    dst_recv = transport.peer_recv(recv_gmem, rank, o)
                  store_tile(subs, dst_recv.at[schedule.recv_slot(o - 1)].at[slices])
                  if "comm" not in skip and o - 1 >= first_eager:
                    # Offset o is computed at step o - 1 (static here). An eager step waits
                    # for its store and announces the tile now (schedule.py).
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                    transport.signal(sems, rank, o, tile, wg_idx)

      def mma_body(_, x_smem, w_smem, acc_ref):
        plgpu.wgmma(acc_ref, x_smem, w_smem.at[:, wg_n_slice])
        plgpu.wgmma_wait(0)
        return acc_ref

      get_pipeline(mma_body, compute_context)(
          x_gmem.at[pl.ds(dst * chunk + row0, cta_tile_m), :],
          w_gmem.at[:, cta_n_slice],
          allocations=pipeline_allocs,
      )

    # Announce this CTA's last tile if it went to a peer with a deferred signal.
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
    if d > 1 and "comm" not in skip:
      cta = lax.axis_index("cluster_grid")
      total = d * tiles
      count = (total - cta + num_ctas - 1) // num_ctas
      last = cta + (count - 1) * num_ctas
      @pl.when((wg_idx < _NUM_COMPUTE_WGS) & (count > 0) & (last // tiles < first_eager))
      def _():
        signal_tile(last)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
