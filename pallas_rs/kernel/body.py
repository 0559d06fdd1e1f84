"""The fused matmul + reduce-scatter Mosaic GPU kernel body (Hopper).

A fork of jax's `hopper_matmul_mgpu.kernel` (same pipeline, tiling and warp specialisation:
two compute warpgroups split the CTA tile along N, one memory warpgroup issues TMA loads) whose
persistent tile loop walks all `num_devices` row chunks in the staggered order of schedule.py
and whose epilogue either hands the tile on towards its owner or reduces the received partials
(docs/design.md section 3). A peer tile goes either straight from the compute CTA to the owner
(`comm_ctas == 0`) or through a local staging buffer that `comm_ctas` dedicated CTAs push to
the owner (section 3.2), so that no compute SM waits at NVLink pace. Communication goes through a
transport (transport.py), so the same body runs on real devices (NVLink) and as virtual ranks
on one GPU (loopback).
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_rs.kernel import comm as comm_lib
from pallas_rs.kernel import schedule
from pallas_rs.kernel.config import Config
from pallas_rs.kernel.config import MatmulDimension

_NUM_COMPUTE_WGS = schedule.NUM_COMPUTE_WGS


def _swizzled(block_minor_elems: int, dtype) -> tuple:
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(block_minor_elems * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


ABLATIONS = frozenset({"comm", "reduce", "gemm", "stage_wait", "recv_store", "owner_wait",
                       "comm_signal", "owner_add"})


def _round(x, dtype):
  """x (f32) rounded to `dtype` and back: one rounding of the unfused path's running sum."""
  return x.astype(dtype).astype(jnp.float32)


def _add_partial(own, run, part, *, ring: bool, out_dtype):
  """The owner's sum, one partial (f32) at a time, in slot order -> (own, run): "fp32" adds it
  to the own fp32 partial `own`; "bf16_ring" to the running bf16 sum `run` (the unfused path's
  rounding per add; None before the first)."""
  if ring:
    return own, part if run is None else _round(run + part, out_dtype)
  return own + part, run


def _finish_sum(own, run, *, ring: bool, out_dtype):
  """The sum after the last partial: "bf16_ring" adds the own partial last, rounded like every
  other partial."""
  if ring and run is not None:
    return run + _round(own, out_dtype)
  return own


def _strided_loop(start, stride, total, body):
  """body(index, local_step) for index = start, start + stride, ... < total."""
  count = jnp.maximum(total - start + stride - 1, 0) // stride
  lax.fori_loop(0, count, lambda i, c: (body(start + i * stride, i), c)[1], None)
  return count


def kernel_body(x_gmem, w_gmem, out_gmem, recv_gmem, stage_gmem=None, *,
                config: Config, num_devices: int, transport,
                skip: frozenset[str] = frozenset()):
  """One rank's program.

  Per rank (transport.bind selects it): x [m, k_shard], w [k_shard, n], out [m // D, n],
  recv [D - 1, m // D, n] (this rank's receive slots, partial_dtype; None when D == 1 or with
  tma_add, where the peer's partial lands in out),
  stage [D - 1, m // D, n] (partial_dtype; only with comm CTAs: this rank's peer tiles, waiting
  to be pushed).

  `skip` leaves stages out, for timing only (the output is then wrong): "comm" keeps every
  partial tile local (stored into this rank's own receive slots, or output with tma_add, or
  only staged) and drops the pushes, signals and waits (same local traffic, no NVLink, no
  synchronisation with peers); "reduce" keeps the waits but not the loads and adds of the
  received partials (tma_add: the own partial is stored, not added);
  "gemm" skips the mainloop (every epilogue handles a tile of zeros), so that the kernel's time
  is that of its data movement (the comm CTAs' push rate, measured inside the kernel);
  "stage_wait" drops the comm CTAs' per-tile wait for a staged tile (with "gemm": the cost of
  those waits); "recv_store" drops a pulling comm CTA's store of what it pulled (its loads
  alone); "owner_wait" drops the owner's wait for its partials (no CTA spins on the counters);
  "owner_add" keeps the owner's loads of the received partials but not its reads of them into
  registers and adds (which of the two its sum waits on); "comm_signal" (only with
  "owner_wait") drops the comm CTAs' per-tile landed signals too, so that they only move data.
  """
  assert skip <= ABLATIONS, skip
  assert "comm_signal" not in skip or "owner_wait" in skip, skip
  # The ablation hooks, decided here once (empty `skip`: every stage runs).
  comm_on, reduce_on, gemm_on = ("comm" not in skip), ("reduce" not in skip), ("gemm" not in skip)
  d = num_devices
  rank = transport.rank()
  out_all = out_gmem  # Every rank's outputs (tma_add: the peer's is where a partial goes).
  x_gmem, w_gmem, out_gmem, recv_local, stage_local = transport.bind(
      rank, x_gmem, w_gmem, out_gmem, recv_gmem, stage_gmem)
  dtype, out_dtype = x_gmem.dtype, out_gmem.dtype
  part_dtype = jnp.dtype(config.partial_dtype) if d > 1 else out_dtype
  m, k_shard = x_gmem.shape
  n = w_gmem.shape[1]
  chunk = m // d
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  cta_tile_m, cta_tile_n = config.cta_tile_m, config.cta_tile_n
  epi_m, epi_n = config.epi_tile_m, config.epi_tile_n
  # Chunks per CTA tile: 2 ("pairs") where a 64-row chunk is one warpgroup tile and the
  # warpgroups stack along M, so each warpgroup's tile has its own destination.
  group = config.chunk_group(m, d)
  pairs = group == 2
  steps = schedule.num_steps(d, group)
  m_iters, n_iters = schedule.tile_grid(chunk, n, cta_tile_m, cta_tile_n, group)
  tiles = m_iters * n_iters
  k_iters = k_shard // tile_k
  num_out_slots = config.num_out_slots
  recv_stages = config.recv_stages
  num_comm = config.comm_ctas if d > 1 else 0
  # comm_mode "owner": no comm CTAs; remote tiles are staged and the owner's compute CTAs load
  # them from the sources' staging in their own epilogue (docs/design.md section 3.2).
  owner_pull = d > 1 and config.comm_mode == "owner"
  staging = bool(num_comm) or owner_pull
  assert staging == (stage_local is not None), (num_comm, owner_pull, stage_gmem)
  # The owner TMA-adds its own partial onto the peers' sum, which lands in its output (D = 2,
  # or D > 2 where pulling comm CTAs add the peers' partials in ring order).
  tma_add = config.tma_add and d > 1
  in_transforms = _swizzled(tile_k, dtype)
  epi_transforms = _swizzled(epi_n, out_dtype)
  part_transforms = _swizzled(epi_n, part_dtype)
  pull = bool(num_comm) and config.comm_mode == "pull"
  assert not tma_add or (recv_gmem is None and (d == 2 or pull)), (d, pull, recv_gmem)
  where = schedule.SemLayout(d, tiles, num_comm, pull, owner_pull)
  sems = transport.semaphores(where.shape) if d > 1 else None
  first_eager = schedule.first_eager_step(d, config.eager_signal_steps)
  ring = config.owner_sum == "bf16_ring" and d > 1
  slot_order = schedule.ring_slots(d) if ring else tuple(range(d - 1))
  walk = lambda lin: schedule.step_and_tile(lin, tiles, steps, config.interleave_steps)
  cta = lax.axis_index("cluster_grid")
  num_ctas = lax.axis_size("cluster_grid")

  wg_m = config.wg_dimension == MatmulDimension.M

  def tile_slices(tile, wg_idx):
    """((m_idx, n_idx), slices): the tile's row and column block and the rows and columns of
    warpgroup `wg_idx`'s part of it, within a [chunk, n] array."""
    m_idx, n_idx = plgpu.planar_snake(tile, (m_iters, n_iters), config.grid_minor_dim,
                                      config.grid_tile_width)
    row0, col0 = m_idx * cta_tile_m, n_idx * cta_tile_n
    if wg_m and not pairs:
      row0 += wg_idx * tile_m
    elif not wg_m:
      col0 += wg_idx * tile_n
    return (m_idx, n_idx), (pl.ds(row0, tile_m), pl.ds(col0, tile_n))

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
  if d > 1 and not tma_add:
    scoped["part_smem"] = plgpu.SMEM((_NUM_COMPUTE_WGS, recv_stages, epi_m, epi_n), part_dtype,
                                     transforms=part_transforms)
    scoped["part_barrier"] = plgpu.Barrier(num_barriers=_NUM_COMPUTE_WGS * recv_stages)
  if d > 1 and part_dtype != out_dtype:
    scoped["send_smem"] = plgpu.SMEM((_NUM_COMPUTE_WGS, num_out_slots, epi_m, epi_n),
                                     part_dtype, transforms=part_transforms)

  def compute_program(cta_index, num_compute):
    """The GEMM: CTA `cta_index` of `num_compute` walks linear tiles cta_index, +num_compute..."""

    @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
    def _scope(pipeline_allocs, out_smem, part_smem=None, part_barrier=None, send_smem=None):
      wg_idx = lax.axis_index("wg")
      epi_tiles = [(mi, ni) for mi in range(tile_m // epi_m) for ni in range(tile_n // epi_n)]
      if send_smem is None:
        send_smem = out_smem

      def epi_slices(mi, ni):
        return slice(mi * epi_m, (mi + 1) * epi_m), slice(ni * epi_n, (ni + 1) * epi_n)

      def announce(offset, tile):
        """Tells whoever moves this warpgroup's remote tile `tile` (for the peer at `offset`)
        next that its stores have landed: the owner (direct push: in its receive slot; pull: in
        this rank's staging buffer) or this rank's comm CTAs (push from staging; staging is
        indexed by the step, remote_step(offset), as comm CTAs run only without pairs)."""
        if num_comm and not pull:
          transport.signal_local(sems, rank, where.staged(schedule.remote_step(offset, d),
                                                          tile, wg_idx))
          return
        for o in range(1, d):  # Static peers: see transport.py.
          @pl.when(offset == o)
          def _():
            idx = (where.staged(schedule.remote_step(o, d), tile, wg_idx)
                   if pull or owner_pull else where.arrived(tile, wg_idx))
            transport.signal(sems, rank, o, idx)

      def store_sub(i, sub, smem, dst_ref, add=False):
        """Epilogue sub-tile i (epi_tiles order) -> its place in dst_ref [tile_m, tile_n]
        through the double-buffered SMEM slots of `smem`; `add`: TMA-added onto what it holds."""
        mi, ni = epi_tiles[i]
        slot = i % num_out_slots
        plgpu.wait_smem_to_gmem(num_out_slots - 1, wait_read_only=True)
        smem[wg_idx, slot] = sub
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem.at[wg_idx, slot], dst_ref.at[epi_slices(mi, ni)],
                                reduction_op="add" if add else None)

      def store_tile(subs, smem, dst_ref, add=False):
        for i, sub in enumerate(subs):
          store_sub(i, sub, smem, dst_ref, add)

      def owner_wait(tile):
        """Until the own tile `tile`'s D - 1 partials have landed (receive slots; tma_add: the
        output)."""
        if comm_on and "owner_wait" not in skip:
          with jax.named_scope("owner_wait"):
            if owner_pull:  # Each source flags its staged tile, which this CTA then loads.
              for step in range(d - 1):
                transport.wait(sems, rank, where.staged(step, tile, wg_idx), 1)
            elif num_comm:  # Each slot's tiles arrive in the order its comm CTA moves them.
              c, need = tile % num_comm, tile // num_comm + 1
              for slot in range(d - 1):
                transport.wait(sems, rank, where.delivered(slot, c, wg_idx), need, local=pull)
            else:
              transport.wait(sems, rank, where.arrived(tile, wg_idx), d - 1)

      def reduce_tile(acc, tile, slices, emit):
        """The own tile's sum of all D partials, each out_dtype sub-tile handed to emit(i, sub)
        as soon as it is summed (config.owner_sum): "fp32": acc (f32) + the received partials
        in slot order, rounded once; "bf16_ring": the unfused path's arithmetic,
        schedule.ring_slots. Emitting as it goes keeps no summed tile live beside acc (with
        D - 1 > 1 partials, holding them spilled registers: BUILD_NOTES 2026-12-01)."""
        owner_wait(tile)
        loads = [(mi, ni, j) for mi, ni in epi_tiles for j in slot_order]
        if not reduce_on:
          loads = []
        # With pairs one warpgroup of the CTA (rank % 2's) sums and the other only sends, so
        # the summing one takes both warpgroups' receive stages: twice the loads in flight.
        stages = _NUM_COMPUTE_WGS * recv_stages if pairs else recv_stages

        def stage(i):
          """(SMEM slot, barrier) of load i."""
          buf = i % stages
          if pairs:
            return part_smem.at[buf // recv_stages, buf % recv_stages], part_barrier.at[buf]
          return part_smem.at[wg_idx, buf], part_barrier.at[wg_idx * recv_stages + buf]

        def partials(j):
          """Slot j's partial [chunk, n]: this rank's receive slot, or (owner pull) the
          staging of its source, at offset D - 1 - j, which computed it at step D - 2 - j
          (this rank's own staging under the "comm" ablation)."""
          if not owner_pull:
            return recv_local.at[j]
          step = schedule.remote_step(j + 1, d)
          return (transport.peer(stage_gmem, rank, d - 1 - j) if comm_on else stage_local
                  ).at[step]

        def issue(i):
          mi, ni, j = loads[i]
          sm, sn = epi_slices(mi, ni)
          plgpu.copy_gmem_to_smem(partials(j).at[slices].at[sm, sn], *stage(i))

        for i in range(min(stages, len(loads))):
          issue(i)
        i = 0
        for e, (mi, ni) in enumerate(epi_tiles):
          sm, sn = epi_slices(mi, ni)
          own = acc[sm, sn]
          run = None  # bf16_ring: the running bf16 sum (held in f32)
          for _ in range(len(loads) // len(epi_tiles)):
            slot, barrier = stage(i)
            plgpu.barrier_wait(barrier)
            if "owner_add" not in skip:
              part = slot[...].astype(jnp.float32)
              own, run = _add_partial(own, run, part, ring=ring, out_dtype=out_dtype)
            if i + stages < len(loads):
              plgpu.commit_smem()  # Every thread has read `slot` before TMA overwrites it.
              issue(i + stages)
            i += 1
          own = _finish_sum(own, run, ring=ring, out_dtype=out_dtype)
          emit(e, own.astype(out_dtype))

      def deferred(step, offset):
        """Whether this warpgroup's tile at `step` (for the peer at `offset`) is announced at
        the CTA's next epilogue: remote, not an eager slot, and (pairs) not sharing its tile
        with the own chunk (the next tile would wait on the own warpgroup's owner wait)."""
        lazy = (offset != 0) & (schedule.remote_step(offset, d) < first_eager)
        return lazy & (step != steps - 1) if pairs else lazy

      def tile_body(lin_idx, local_step):
        step, tile = walk(lin_idx)
        offset = schedule.wg_offset(rank, step, wg_idx, d, group)  # This warpgroup's peer.
        first_dst = schedule.wg_dst(rank, step, 0, d, group)  # The tile's first chunk.
        (m_idx, n_idx), slices = tile_slices(tile, wg_idx)
        cta_n_slice = pl.ds(n_idx * cta_tile_n, cta_tile_n)
        # This warpgroup's part of the CTA's x and w blocks.
        wg_x = pl.ds(wg_idx * tile_m, tile_m) if wg_m else slice(None)
        wg_w = slice(None) if wg_m else pl.ds(wg_idx * tile_n, tile_n)

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def _acc_scope(acc_ref):
            with jax.named_scope("mainloop"):
              eval_pipeline(acc_ref)
            # The previous tile's stores had this tile's whole mainloop to land.
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)
            if d > 1 and comm_on:
              prev_step, prev_tile = walk(lin_idx - num_compute)
              prev_offset = schedule.wg_offset(rank, prev_step, wg_idx, d, group)
              @pl.when((local_step > 0) & deferred(prev_step, prev_offset))
              def _():
                announce(prev_offset, prev_tile)

            is_own = offset == 0

            @pl.when(is_own)
            @jax.named_scope("own_epilogue")
            def _own():
              if d > 1 and not tma_add:
                reduce_tile(acc_ref[...], tile, slices,
                            lambda i, sub: store_sub(i, sub, out_smem, out_gmem.at[slices]))
              else:
                if tma_add:  # The ring's last rounded add, by TMA: bf16(peers + bf16(own)).
                  owner_wait(tile)
                acc = acc_ref[...].astype(out_dtype)
                store_tile([acc[epi_slices(mi, ni)] for mi, ni in epi_tiles], out_smem,
                           out_gmem.at[slices], add=tma_add and reduce_on)

            if d > 1:
              @pl.when(jnp.logical_not(is_own))
              @jax.named_scope("remote_epilogue")
              def _remote():
                acc = acc_ref[...].astype(part_dtype)
                subs = [acc[epi_slices(mi, ni)] for mi, ni in epi_tiles]
                if staging:
                  # Local staging at HBM speed; comm CTAs or the owner move it on.
                  store_tile(subs, send_smem, stage_local.at[step].at[slices])
                for o in range(1, d):
                  @pl.when(offset == o)
                  def _():
                    if not staging:
                      # Into the owner's output to add onto (tma_add), else its receive slot;
                      # this rank's own buffer under the "comm" ablation.
                      whole, local = (out_all, out_gmem) if tma_add else (recv_gmem, recv_local)
                      dst = transport.peer(whole, rank, o) if comm_on else local
                      if not tma_add:
                        dst = dst.at[schedule.recv_slot(o)]
                      store_tile(subs, send_smem, dst.at[slices])
                    def announce_now(o=o):
                      plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                      announce(o, tile)

                    # An eager step (static: remote_step(o)), or a pair's remote half beside
                    # the own chunk, waits for its store and announces the tile now (deferred()).
                    if comm_on and schedule.remote_step(o, d) >= first_eager:
                      announce_now()
                    elif comm_on and pairs:
                      pl.when(step == steps - 1)(announce_now)

        def mma_body(_, x_smem, w_smem, acc_ref):
          plgpu.wgmma(acc_ref, x_smem.at[wg_x], w_smem.at[:, wg_w])
          plgpu.wgmma_wait(0)
          return acc_ref

        if not gemm_on:
          @pl.when(wg_idx < _NUM_COMPUTE_WGS)
          def _():
            compute_context(lambda acc_ref: None)  # The epilogue of a tile of zeros.
        else:
          get_pipeline(mma_body, compute_context)(
              x_gmem.at[pl.ds(first_dst * chunk + m_idx * cta_tile_m, cta_tile_m), :],
              w_gmem.at[:, cta_n_slice],
              allocations=pipeline_allocs,
          )

      total = steps * tiles
      count = _strided_loop(cta_index, num_compute, total, tile_body)
      # Announce this CTA's last tile if it went to a peer with a deferred signal.
      plgpu.wait_smem_to_gmem(0, wait_read_only=False)
      if d > 1 and comm_on:
        last_step, last_tile = walk(cta_index + (count - 1) * num_compute)
        last_offset = schedule.wg_offset(rank, last_step, wg_idx, d, group)
        @pl.when((wg_idx < _NUM_COMPUTE_WGS) & (count > 0) & deferred(last_step, last_offset))
        def _():
          announce(last_offset, last_tile)

      if owner_pull and comm_on:
        # Every load was waited on before its sum: this warpgroup reads no peer any more. A
        # rank exits only once its peers are done with its staging (XLA may reuse it).
        @pl.when(wg_idx < _NUM_COMPUTE_WGS)
        def _():
          for o in range(1, d):
            transport.signal(sems, rank, o, where.done())

        @pl.when((cta_index == 0) & (wg_idx == 0))
        @jax.named_scope("exit_wait")
        def _():
          transport.wait(sems, rank, where.done(),
                         schedule.pull_done_target(d, num_compute))

  if num_comm and comm_on:
    ctx = comm_lib.CommContext(
        config=config, num_devices=d, num_comm=num_comm, rank=rank, transport=transport,
        sems=sems, where=where, tiles=tiles, part_dtype=part_dtype, tile_slices=tile_slices,
        recv_gmem=recv_gmem, recv_local=recv_local, stage_gmem=stage_gmem,
        stage_local=stage_local, out_gmem=out_all, out_local=out_gmem,
        stage_wait="stage_wait" not in skip,
        recv_store="recv_store" not in skip, signal="comm_signal" not in skip)

    @pl.when(cta < num_comm)
    def _comm():
      (comm_lib.pull_program if pull else comm_lib.push_program)(ctx, cta)

  if num_comm:
    @pl.when(cta >= num_comm)
    def _compute():
      compute_program(cta - num_comm, num_ctas - num_comm)
  else:
    compute_program(cta, num_ctas)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
