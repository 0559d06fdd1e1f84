"""The owner's sum spread over every compute warpgroup of a rank (Config.owner_spread).

At small M the own chunk's tiles fill a fraction of one wave (D = 8, M = 512: 32 of 132 CTAs),
and in the owner's epilogue (body.py) each of them adds D - 1 partials, a few sub-tile loads in
flight at a time: the kernel's tail (docs/design.md section 3). With owner_spread the own tiles
store their own partial locally instead (body.py's store_own) and, after its tile loop, compute
warpgroup g of the rank's G sums the own chunk's epilogue sub-tiles g, g + G, ... here, in an
SMEM scope of its own (the pipeline's buffers are free by then), with every load of a sub-tile
in flight at once. The values and their order are the owner epilogue's, so the output is the
same bit for bit. schedule.spread_units and schedule.simulate(spread_subs=...) model the walk.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax
import jax.numpy as jnp

from pallas_rs.kernel import schedule
from pallas_rs.kernel.config import Config

_NUM_COMPUTE_WGS = schedule.NUM_COMPUTE_WGS


@dataclasses.dataclass(frozen=True)
class SpreadContext:
  """What the spread sum shares with the rest of one rank's kernel (body.kernel_body)."""
  config: Config
  num_devices: int
  rank: Any
  transport: Any
  sems: Any
  where: schedule.SemLayout
  tiles: int  # output tiles per row chunk
  group: int  # chunks per CTA tile (schedule.chunk_group)
  part_dtype: Any
  out_dtype: Any
  tile_slices: Callable  # (tile, wg) -> ((m_idx, n_idx), (rows, cols)) in a [chunk, n] array
  transforms: Callable  # (epi_tile_n, dtype) -> the SMEM transforms of a sub-tile
  recv_local: Any  # this rank's receive slots [D - 1, chunk, n]
  own_local: Any  # this rank's own partial [chunk, n]
  out_local: Any  # this rank's output [chunk, n]
  slot_order: tuple[int, ...]  # the partials' order (slots; ring order for "bf16_ring")
  peers: bool = True  # False under the "comm" ablation: only the own partial is awaited
  wait: bool = True  # False under the "owner_wait" ablation
  partials: bool = True  # False under the "reduce" ablation: the own partial alone
  add: bool = True  # False under the "owner_add" ablation: the partials loaded, not added


def _round(x, dtype):
  """x (f32) rounded to `dtype` and back: one rounding of the unfused path's running sum."""
  return x.astype(dtype).astype(jnp.float32)


def add_partial(own, run, part, *, ring: bool, out_dtype):
  """The owner's sum, one partial (f32) at a time, in slot order -> (own, run): "fp32" adds it
  to the own fp32 partial `own`; "bf16_ring" to the running bf16 sum `run` (the unfused path's
  rounding per add; None before the first). The owner's epilogue (body.reduce_tile) and the
  spread sum share it, so that their outputs agree bit for bit."""
  if ring:
    return own, part if run is None else _round(run + part, out_dtype)
  return own + part, run


def finish_sum(own, run, *, ring: bool, out_dtype):
  """The sum after the last partial: "bf16_ring" adds the own partial last, rounded like every
  other partial."""
  if ring and run is not None:
    return run + _round(own, out_dtype)
  return own


def spread_program(ctx: SpreadContext, cta_index, num_compute) -> None:
  """Compute CTA `cta_index` of `num_compute`: its two warpgroups' shares of the own chunk.
  Called by all of the CTA's warpgroups (the SMEM scope is collective)."""
  cfg = ctx.config
  epi_m, epi_n = cfg.epi_tile_m, cfg.epi_tile_n
  own_f32 = cfg.own_partial_itemsize == 4
  # Sources in the order they are added: the partials (slot order), then, when it is stored in
  # the partial dtype (the ring adds it last), the own partial.
  slots = ctx.slot_order if ctx.partials else ()
  n_srcs = len(slots) + (0 if own_f32 else 1)
  allocs = dict(
      out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, epi_m, epi_n), ctx.out_dtype,
                          transforms=ctx.transforms(epi_n, ctx.out_dtype)),
      part_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, max(n_srcs, 1), epi_m, epi_n), ctx.part_dtype,
                           transforms=ctx.transforms(epi_n, ctx.part_dtype)),
      part_barrier=plgpu.Barrier(num_barriers=_NUM_COMPUTE_WGS * max(n_srcs, 1)),
  )
  if own_f32:
    allocs["own_smem"] = plgpu.SMEM((_NUM_COMPUTE_WGS, epi_m, epi_n), jnp.float32,
                                    transforms=ctx.transforms(epi_n, jnp.float32))
    allocs["own_barrier"] = plgpu.Barrier(num_barriers=_NUM_COMPUTE_WGS)

  @functools.partial(pl.run_scoped, collective_axes="wg", **allocs)
  def _scope(out_smem, part_smem, part_barrier, own_smem=None, own_barrier=None):
    wg_idx = lax.axis_index("wg")
    parts = _NUM_COMPUTE_WGS if ctx.group == 1 else 1
    subs_n = cfg.tile_n // epi_n
    subs = (cfg.tile_m // epi_m) * subs_n
    srcs = [ctx.recv_local.at[j] for j in slots] + ([] if own_f32 else [ctx.own_local])
    ring = cfg.owner_sum == "bf16_ring"

    def unit(u, carry):
      tile, rest = u // (parts * subs), u % (parts * subs)
      piece = rest // subs if ctx.group == 1 else ctx.rank % 2  # Pairs: the own warpgroup's.
      sub = rest % subs
      _, slices = ctx.tile_slices(tile, piece)
      box = (pl.ds(sub // subs_n * epi_m, epi_m), pl.ds(sub % subs_n * epi_n, epi_n))
      if ctx.wait:  # D - 1 peers and the own partial (only the own one without peers).
        ctx.transport.wait(ctx.sems, ctx.rank, ctx.where.arrived(tile, piece),
                           ctx.num_devices if ctx.peers else 1, local=not ctx.peers)
      if own_f32:
        plgpu.copy_gmem_to_smem(ctx.own_local.at[slices].at[box], own_smem.at[wg_idx],
                                own_barrier.at[wg_idx])
      for i, src in enumerate(srcs):  # Every load of the sub-tile in flight at once.
        plgpu.copy_gmem_to_smem(src.at[slices].at[box], part_smem.at[wg_idx, i],
                                part_barrier.at[wg_idx * n_srcs + i])
      # Registers in the accumulator's layout, as in the owner's epilogue (whose sum starts
      # from the wgmma accumulator); here nothing else would pick one (profiled 2026-12-01:
      # ~15 us for a sub-tile's 8 loads and adds without it; with it, not yet measured).
      wgmma = lambda ref: plgpu.layout_cast(ref[...], plgpu.Layout.WGMMA)
      own = run = None
      if own_f32:
        plgpu.barrier_wait(own_barrier.at[wg_idx])
        own = wgmma(own_smem.at[wg_idx])
      for i in range(n_srcs):  # body.reduce_tile's arithmetic, in its order.
        plgpu.barrier_wait(part_barrier.at[wg_idx * n_srcs + i])
        if i < len(slots) and not ctx.add:
          continue
        part = wgmma(part_smem.at[wg_idx, i]).astype(jnp.float32)
        if i < len(slots):
          own, run = add_partial(own, run, part, ring=ring, out_dtype=ctx.out_dtype)
        else:
          own = part  # The own partial, stored in the partial dtype (ring).
      own = finish_sum(own, run, ring=ring, out_dtype=ctx.out_dtype)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # out_smem free; `part_smem` read
      out_smem[wg_idx] = own.astype(ctx.out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem.at[wg_idx], ctx.out_local.at[slices].at[box])
      return carry

    @pl.when(wg_idx < _NUM_COMPUTE_WGS)
    def _():
      g, stride = cta_index * _NUM_COMPUTE_WGS + wg_idx, num_compute * _NUM_COMPUTE_WGS
      count = jnp.maximum(ctx.tiles * parts * subs - g + stride - 1, 0) // stride
      lax.fori_loop(0, count, lambda i, c: unit(g + i * stride, c), None)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
