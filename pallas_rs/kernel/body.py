"""The fused matmul + reduce-scatter Mosaic GPU kernel body (Hopper).

A fork of jax's `hopper_matmul_mgpu.kernel` (same pipeline, tiling and warp specialisation:
two compute warpgroups split the CTA tile along N, one memory warpgroup issues TMA loads) whose
persistent tile loop walks all `num_devices` row chunks in the staggered order of schedule.py
and whose epilogue either hands the tile on towards its owner or reduces the received partials
(docs/design.md section 3). A peer tile goes either straight from the compute CTA to the owner
(`comm_ctas == 0`) or through a local staging buffer that `comm_ctas` dedicated CTAs push to
the owner (section 3.2), so that no compute SM waits at NVLink pace. Communication goes through a
transport (transport.py), so the same body runs on real devices (NVLink) and as virtual ranks
on one GPU (loopback). With Config.pingpong the two warpgroups compute their tiles of a CTA
tile in turn through one SMEM ring (pingpong.Ring) instead of jax's pipeline, so that one's
epilogue runs under the other's mainloop (section 3.7); the epilogue is the same.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_rs.kernel import comm as comm_lib
from pallas_rs.kernel import pingpong
from pallas_rs.kernel import schedule
from pallas_rs.kernel.config import Config
from pallas_rs.kernel.epilogue import Epilogue
from pallas_rs.kernel.rank import Hooks
from pallas_rs.kernel.rank import Rank

_NUM_COMPUTE_WGS = schedule.NUM_COMPUTE_WGS
# Registers a thread of the memory / compute warpgroups (jax's pipeline's split for memory 40).
_MEMORY_REGISTERS = 40
_CONSUMER_REGISTERS = 232


def _swizzled(block_minor_elems: int, dtype) -> tuple:
  """The TMA transforms of an SMEM block whose minor dimension has `block_minor_elems`."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(block_minor_elems * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _strided_count(start, stride, total):
  """How many of start, start + stride, ... are < total."""
  return jnp.maximum(total - start + stride - 1, 0) // stride


def _strided_loop(start, stride, count, body):
  """body(index, local_step) for the first `count` of index = start, start + stride, ..."""
  lax.fori_loop(0, count, lambda i, c: (body(start + i * stride, i), c)[1], None)


def kernel_body(x_gmem, w_gmem, out_gmem, recv_gmem, stage_gmem=None, *,
                config: Config, num_devices: int, transport,
                skip: frozenset[str] = frozenset()):
  """One rank's program: comm CTAs (comm.py) and compute CTAs (`_compute_program`).

  Per rank (transport.bind selects it): x [m, k_shard], w [k_shard, n], out [m // D, n],
  recv [D - 1, m // D, n] (this rank's receive slots, partial_dtype; [1, m // D, n] with
  sum_slot; None when D == 1, with sum_in_output, where the peers' partials land in out, or
  with comm_mode "owner"), stage
  [D - 1, m // D, n] (partial_dtype; with comm CTAs or "owner": this rank's peer tiles, waiting
  to be moved). `skip` leaves stages out, for timing only (rank.Hooks says which).
  """
  hooks = Hooks.skipping(skip)
  d = num_devices
  rank = transport.rank()
  out_all = out_gmem  # Every rank's outputs (sum_in_output: where a peer's partial goes).
  x_gmem, w_gmem, out_gmem, recv_local, stage_local = transport.bind(
      rank, x_gmem, w_gmem, out_gmem, recv_gmem, stage_gmem)
  k = Rank(config=config, d=d, hooks=hooks, transport=transport, rank=rank, sems=None,
           x=x_gmem, w=w_gmem, out=out_gmem, out_all=out_all, recv_gmem=recv_gmem,
           recv_local=recv_local, stage_gmem=stage_gmem, stage_local=stage_local)
  if d > 1:
    k = dataclasses.replace(k, sems=transport.semaphores(k.where.shape))
  num_comm = k.num_comm
  assert k.staging == (stage_local is not None), (num_comm, k.owner_pull, stage_gmem)
  # tma_add: D = 2, or D > 2 where pulling comm CTAs add the peers' partials in ring order.
  assert not k.sum_in_output or (recv_gmem is None and (d == 2 or k.pull)), (d, k.pull)
  assert not k.sum_slot or (recv_local.shape[0] == 1 and k.pull and d > 2), (d, k.pull)
  cta = lax.axis_index("cluster_grid")
  num_ctas = lax.axis_size("cluster_grid")
  scoped = _allocations(k)

  if num_comm and hooks.comm:
    @pl.when(cta < num_comm)
    def _comm():
      (comm_lib.pull_program if k.pull else comm_lib.push_program)(k, cta)

  if num_comm:
    @pl.when(cta >= num_comm)
    def _compute():
      _compute_program(k, scoped, cta - num_comm, num_ctas - num_comm)
  else:
    _compute_program(k, scoped, cta, num_ctas)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _pipeline(k: Rank, pipeline_body, compute_context, state=None):
  """jax's warp-specialised pipeline over k_shard for one CTA tile (the mainloop); `state`
  (Config.prefetch_tiles): jax's pipeline of pipelines, whose memory warpgroup goes on into
  the CTA's next tile instead of draining at the end of this one."""
  c = k.config
  in_transforms = _swizzled(c.operand_swizzle_cols, k.x.dtype)
  return plgpu.emit_pipeline_warp_specialized(
      pipeline_body,
      grid=(k.x.shape[1] // c.tile_k,),
      memory_registers=_MEMORY_REGISTERS,
      in_specs=[
          plgpu.BlockSpec((c.cta_tile_m, c.tile_k), lambda kk: (0, kk),
                          transforms=in_transforms, memory_space=plgpu.SMEM),
          plgpu.BlockSpec((c.tile_k, c.cta_tile_n), lambda kk: (kk, 0),
                          transforms=in_transforms, memory_space=plgpu.SMEM),
      ],
      wg_axis="wg",
      num_compute_wgs=_NUM_COMPUTE_WGS,
      max_concurrent_steps=c.max_concurrent_steps,
      compute_context=compute_context,
      pipeline_state=state,
  )


def _spread_steps(sub_tiles: int, blocks: int) -> list[int]:
  """Config.spread_stores: the k step of the next tile at which each sub-tile's store leaves,
  evenly over its blocks."""
  return [(i * blocks) // sub_tiles for i in range(sub_tiles)]


def _quiesce_prefetch(k: Rank, pipeline_allocs, wg_idx, count) -> None:
  """With Config.prefetch_tiles, what jax's last pipeline (state STOP) does, which no tile can
  be told in advance (a CTA's first tile may be its last): the memory warpgroup waits until
  the compute warpgroups have released the last tile's slots, one per pipeline slot."""
  @pl.when((wg_idx == _NUM_COMPUTE_WGS) & (count > 0))
  def _():
    for slot in range(k.config.pipeline_slots(k.x.shape[1])):
      for barrier in pipeline_allocs["flat_consumed_barrier_refs"]:
        plgpu.barrier_wait(barrier.at[slot])


def _allocations(k: Rank) -> dict:
  """A compute CTA's SMEM: the pipeline's, the output's epilogue slots and, with D > 1, the
  owner's receive stages (not with sum_in_output) and the partials' slots (another dtype)."""
  c, d = k.config, k.d
  out_dtype, part_dtype = k.out.dtype, k.part_dtype
  epi = (c.epi_tile_m, c.epi_tile_n)
  ignore = lambda *_, **__: None
  scoped = dict(
      pipeline_allocs=(
          pingpong.Ring.allocations(c.tile_m, c.tile_n, c.tile_k, c.max_concurrent_steps,
                                    k.x.dtype, _swizzled(c.operand_swizzle_cols, k.x.dtype))
          if c.pingpong
          else _pipeline(k, ignore, ignore).get_allocations(k.x, k.w)),
      out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, c.num_out_slots, *epi), out_dtype,
                          transforms=_swizzled(c.epi_tile_n, out_dtype)),
  )
  part_transforms = _swizzled(c.epi_tile_n, part_dtype)
  if d > 1 and not k.sum_in_output:
    scoped["part_smem"] = plgpu.SMEM((_NUM_COMPUTE_WGS, c.recv_stages, *epi), part_dtype,
                                     transforms=part_transforms)
    scoped["part_barrier"] = plgpu.Barrier(num_barriers=_NUM_COMPUTE_WGS * c.recv_stages)
  if d > 1 and part_dtype != out_dtype:
    scoped["send_smem"] = plgpu.SMEM((_NUM_COMPUTE_WGS, c.num_out_slots, *epi), part_dtype,
                                     transforms=part_transforms)
  return scoped


def _compute_program(k: Rank, scoped: dict, cta_index, num_compute):
  """The GEMM: CTA `cta_index` of `num_compute` walks linear tiles cta_index, +num_compute,
  ...; per tile the mainloop, then the previous tile's deferred announcement and the tile's
  epilogue (epilogue.py); after the loop the last deferred announcement and, with "owner",
  the exit handshake."""
  c = k.config
  blocks = k.x.shape[1] // c.tile_k

  @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
  def _scope(pipeline_allocs, out_smem, part_smem=None, part_barrier=None, send_smem=None):
    wg_idx = lax.axis_index("wg")
    epi = Epilogue(k, wg_idx, out_smem, out_smem if send_smem is None else send_smem,
                   part_smem, part_barrier)

    def tile_body(lin_idx, local_step):
      # spread_stores: the CTA's last tile has no next one to spread its stores over.
      epi_t = dataclasses.replace(epi, last=local_step == last_step) if k.spread else epi
      row, col = _cta_origin(k, lin_idx, wg_idx)  # The CTA tile's x rows and w columns.
      # This warpgroup's part of the CTA's x and w blocks.
      wg_x = pl.ds(wg_idx * c.tile_m, c.tile_m) if k.wg_m else slice(None)
      wg_w = slice(None) if k.wg_m else pl.ds(wg_idx * c.tile_n, c.tile_n)
      if k.spread:  # Where the previous tile goes: once a tile, not once a k block.
        p_step, p_tile = k.walk(lin_idx - num_compute)
        ((_, p_offset),) = k.parts(p_step, wg_idx)  # (no pairs: check_shape)
        spread_prev = functools.partial(epi.spread_tile, p_step, p_tile, p_offset,
                                        k.tile_slices(p_tile, wg_idx)[1])

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          with jax.named_scope("mainloop"):
            eval_pipeline(acc_ref)
          _tile_epilogue(k, epi_t, acc_ref, lin_idx, local_step > 0, num_compute, wg_idx)

      def mma_body(indices, x_smem, w_smem, acc_ref):
        (block,) = indices  # This tile's k block.
        plgpu.wgmma(acc_ref, x_smem.at[wg_x], w_smem.at[:, wg_w])
        if k.spread:  # The previous tile's sub-tiles leave over this tile's blocks.
          for i, at in enumerate(_spread_steps(c.sub_tiles, blocks)):
            pl.when((block == at) & (local_step > 0))(functools.partial(spread_prev, i))
        plgpu.wgmma_wait(0)
        return acc_ref

      if not k.hooks.gemm:
        @pl.when(wg_idx < _NUM_COMPUTE_WGS)
        def _():
          compute_context(lambda acc_ref: None)  # The epilogue of a tile of zeros.
      else:
        state = None
        if c.prefetch_tiles:  # The CTA's first tile fills the pipeline; the others go on.
          state = jnp.where(local_step == 0, plgpu.PipelinePipeline.START,
                            plgpu.PipelinePipeline.STEADY)
        _pipeline(k, mma_body, compute_context, state)(
            k.x.at[pl.ds(row, c.cta_tile_m), :],
            k.w.at[:, pl.ds(col, c.cta_tile_n)],
            allocations=pipeline_allocs,
        )

    count = _strided_count(cta_index, num_compute, k.steps * k.tiles)
    last_step = count - 1
    if c.pingpong:
      _pingpong_tiles(k, epi, pingpong.Ring(*pipeline_allocs, c.max_concurrent_steps), wg_idx,
                      cta_index, num_compute, count)
    else:
      _strided_loop(cta_index, num_compute, count, tile_body)
    if c.prefetch_tiles and k.hooks.gemm:
      _quiesce_prefetch(k, pipeline_allocs, wg_idx, count)
    # Announce this CTA's last tile if it went to a peer with a deferred signal.
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
    epi.announce_deferred(cta_index + (count - 1) * num_compute,
                          lambda: (wg_idx < _NUM_COMPUTE_WGS) & (count > 0))

    if k.owner_pull and k.hooks.comm:
      epi.exit_handshake(cta_index, num_compute)


def _cta_origin(k: Rank, lin_idx, wg_idx):
  """(first row of x, first column of w) of the CTA tile at `lin_idx`: its first chunk's rows
  (schedule.wg_dst at row block 0) in the staggered walk."""
  c = k.config
  step, tile = k.walk(lin_idx)
  first_dst = schedule.wg_dst(k.rank, step, 0, k.d, k.group)
  (m_idx, n_idx), _ = k.tile_slices(tile, wg_idx)
  return first_dst * (k.x.shape[0] // k.d) + m_idx * c.cta_tile_m, n_idx * c.cta_tile_n


def _tile_epilogue(k: Rank, epi: Epilogue, acc_ref, lin_idx, after_first, num_compute, wg_idx):
  """After a warpgroup's mainloop of the tile at `lin_idx`: its previous tile's deferred
  announcement (`after_first`: there was one), then the tile's own or remote epilogue."""
  # The previous tile's stores had this tile's whole mainloop to land.
  plgpu.wait_smem_to_gmem(0, wait_read_only=False)
  epi.announce_deferred(lin_idx - num_compute, lambda: after_first)
  step, tile = k.walk(lin_idx)
  parts = k.parts(step, wg_idx)  # (rows, offset of their peer) of this warpgroup's tile
  slices = k.tile_slices(tile, wg_idx)[1]

  def part_acc(rows):
    return (lambda: acc_ref[...]) if rows is None else (lambda: acc_ref[...][rows])

  def own(rows, offset):
    pl.when(offset == 0)(jax.named_scope("own_epilogue")(
        lambda: epi.own(part_acc(rows), tile, slices)))

  def remote(rows, offset):
    if k.d > 1:
      pl.when(offset != 0)(jax.named_scope("remote_epilogue")(
          lambda: epi.remote(part_acc(rows), step, tile, offset, slices)))

  if not k.split_halves:
    ((rows, offset),) = parts
    own(rows, offset)
    remote(rows, offset)
    return
  # Split halves: the remote ones first (the pair partner's own half waits for this
  # warpgroup's remote half while this one's own half waits for the partner's), each
  # half's sub-tiles starting again at SMEM slot 0 once the previous half's are read.
  for i, (phase, (rows, offset)) in enumerate(
      [(remote, part) for part in parts] + [(own, part) for part in parts]):
    if i:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    phase(rows, offset)


def _pingpong_tiles(k: Rank, epi: Epilogue, ring, wg_idx, cta_index, num_compute, count):
  """Config.pingpong: the CTA's `count` tiles (linear indices cta_index, +num_compute, ...),
  each as its two warpgroup tiles in turn through `ring` (global step (2 t + wg) blocks + kk
  for the CTA's t-th tile), so that one warpgroup's epilogue runs under the other's mainloop;
  each warpgroup's epilogue as the cooperative kernel's (per warpgroup already)."""
  c = k.config
  blocks = k.x.shape[1] // c.tile_k

  def operands(lin_idx, wg):
    """Warpgroup wg's rows of x and columns of w for the tile at lin_idx (no pairs)."""
    row, col = _cta_origin(k, lin_idx, wg)
    row, col = (row + wg * c.tile_m, col) if k.wg_m else (row, col + wg * c.tile_n)
    return k.x.at[pl.ds(row, c.tile_m)], k.w.at[:, pl.ds(col, c.tile_n)]

  if k.hooks.gemm:
    @pl.when(wg_idx == _NUM_COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

      def tile(lin_idx, local_step):
        for wg in range(_NUM_COMPUTE_WGS):
          x_rows, w_cols = operands(lin_idx, wg)

          @pl.loop(0, blocks)
          def _block(kk, wg=wg, x_rows=x_rows, w_cols=w_cols):
            ks = pl.ds(kk * c.tile_k, c.tile_k)
            ring.load((_NUM_COMPUTE_WGS * local_step + wg) * blocks + kk, wg,
                      x_rows.at[:, ks], w_cols.at[ks, :])

      _strided_loop(cta_index, num_compute, count, tile)
      ring.drain(_NUM_COMPUTE_WGS * count * blocks)

  @pl.when(wg_idx < _NUM_COMPUTE_WGS)
  def _consume():
    if k.hooks.gemm:
      plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")

    def tile(lin_idx, local_step):
      @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
      def _(acc_ref):
        if k.hooks.gemm:
          with jax.named_scope("mainloop"):
            ring.mainloop(acc_ref, wg_idx, (_NUM_COMPUTE_WGS * local_step + wg_idx) * blocks,
                          blocks)
        _tile_epilogue(k, epi, acc_ref, lin_idx, local_step > 0, num_compute, wg_idx)

    _strided_loop(cta_index, num_compute, count, tile)
