"""The epilogue phases of a compute warpgroup (docs/design.md section 3): what happens to a
finished tile. A peer's tile goes towards its owner (`remote`: the direct push, or staging for
comm CTAs or the owner to move, then `announce`); the own chunk's tile waits for the peers'
partials (`owner_wait`) and sums them (`owner_sum`, or the owner's TMA add) in `own`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_rs.kernel import schedule
from pallas_rs.kernel.rank import Rank

_NUM_COMPUTE_WGS = schedule.NUM_COMPUTE_WGS


def _round(x, dtype):
  """x (f32) rounded to `dtype` and back: one rounding of the unfused path's running sum."""
  return x.astype(dtype).astype(jnp.float32)


def _add_partial(run, part, *, ring: bool, out_dtype):
  """The running sum of the received partials (f32; None before the first), one more added in
  ring order: "bf16_ring" rounds it after every add (the unfused path's rounding), "fp32" not."""
  if run is None:
    return part
  return _round(run + part, out_dtype) if ring else run + part


def _finish_sum(own, run, *, ring: bool, out_dtype):
  """The own partial added last: "bf16_ring" rounded to bf16 like every other partial, "fp32"
  as it is (one rounding of the whole sum follows)."""
  if run is None:
    return own
  return run + (_round(own, out_dtype) if ring else own)


@dataclasses.dataclass(frozen=True)
class Epilogue:
  """Compute warpgroup `wg` of one rank's CTA, with its CTA's epilogue SMEM: `out_smem` (the
  output's sub-tiles on their way out), `send_smem` (the partials', when their dtype differs),
  `part_smem` / `part_barrier` (the owner's receive stages; None with sum_in_output)."""
  k: Rank
  wg: Any
  out_smem: Any
  send_smem: Any
  part_smem: Any = None
  part_barrier: Any = None
  last: Any = None  # spread_stores: whether this is the CTA's last tile (its stores leave now)

  def store_sub(self, i, sub, smem, dst_ref, add=False):
    """Epilogue sub-tile i (epi_tiles order) -> its place in dst_ref [tile_m, tile_n]
    through the double-buffered SMEM slots of `smem`; `add`: TMA-added onto what it holds.
    `dst_ref` may be [(when, ref thunk), ...] with exactly one `when` true (a peer chosen at
    run time among static ones): the sub-tile is written to SMEM once and only its TMA
    store is emitted per peer (written per peer, the register-to-SMEM code was in the module
    D - 1 times: 20-32% of the D = 8 module's lowering time, docs/design.md section 4)."""
    if self.k.spread and not add:
      smem[self.wg, i] = sub  # Its store leaves during the CTA's next tile (`spread_tile`),
      plgpu.commit_smem()
      pl.when(self.last)(lambda: self.spread_store(i, smem, dst_ref))  # or now: no next tile.
      return
    slots = self.k.config.num_out_slots
    slot = i % slots
    if self.k.hooks.store:
      plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
    smem[self.wg, slot] = sub
    if not self.k.hooks.store:
      return  # Written to SMEM, which keeps the tile's wgmmas (unread, Pallas drops them).
    plgpu.commit_smem()
    self._copy_out(smem.at[self.wg, slot], dst_ref, i, add)

  def _copy_out(self, src, dst_ref, i, add=False):
    """The TMA store of the SMEM sub-tile `src` to sub-tile i of `dst_ref` (store_sub's)."""
    mi, ni = self.k.epi_tiles[i]
    targets = dst_ref if isinstance(dst_ref, list) else [(None, lambda: dst_ref)]
    for when, ref in targets:
      def copy(ref=ref):
        plgpu.copy_smem_to_gmem(src, ref().at[self.k.epi_slices(mi, ni)],
                                reduction_op="add" if add else None)
      if when is None:
        copy()
      else:
        pl.when(when)(copy)

  def spread_store(self, i, smem, dst_ref):
    """Config.spread_stores: the TMA store of sub-tile i, in slot i of `smem` since the
    epilogue of its tile, whose place is `dst_ref` (store_sub's forms)."""
    self._copy_out(smem.at[self.wg, i], dst_ref, i)

  def spread_tile(self, step, tile, offset, slices, i):
    """Config.spread_stores, from the CTA's next tile: sub-tile i's store of this warpgroup's
    tile at (step, tile) (for the rank at `offset`; `slices` as in tile_slices): into the
    output if own (unless TMA-added: stored at once), else towards its owner (remote_dst)."""
    k = self.k
    if not self.own_adds:
      pl.when(offset == 0)(lambda: self.spread_store(i, self.out_smem, k.out.at[slices]))
    if k.d > 1:
      pl.when(offset != 0)(lambda: self.spread_store(
          i, self.send_smem, self.remote_dst(step, offset, slices)))

  @property
  def own_adds(self) -> bool:
    """The own tile is TMA-added onto the peers' partials in the output (sum_in_output)."""
    return self.k.sum_in_output and self.k.hooks.reduce

  def store_tile(self, subs, smem, dst_ref, add=False):
    for i, sub in enumerate(subs):
      self.store_sub(i, sub, smem, dst_ref, add)

  def announce(self, offset, tile):
    """Tells whoever moves this warpgroup's remote tile `tile` (for the peer at `offset`)
    next that its stores have landed: the owner (direct push: in its receive slot; pull and
    "owner": in this rank's staging buffer) or this rank's comm CTAs (push from staging;
    staging is indexed by the step, remote_step(offset), as comm CTAs run only without
    pairs)."""
    k, d = self.k, self.k.d
    if k.num_comm and not k.pull:
      k.transport.signal_local(k.sems, k.rank, k.where.staged(schedule.remote_step(offset, d),
                                                              tile, self.wg))
      return
    for o in range(1, d):  # Static peers: see transport.py.
      @pl.when(offset == o)
      def _():
        idx = (k.where.staged(schedule.remote_step(o, d), tile, self.wg)
               if k.pull or k.owner_pull else k.where.arrived(tile, self.wg))
        k.transport.signal(k.sems, k.rank, o, idx)

  def deferred(self, step, offset):
    """Whether this warpgroup's tile at `step` (for the peer at `offset`) is announced at
    the CTA's next epilogue: remote, not an eager slot, and (pairs) not sharing its tile
    with the own chunk (the next tile would wait on the own warpgroup's owner wait)."""
    k = self.k
    lazy = (offset != 0) & (schedule.remote_step(offset, k.d) < k.first_eager)
    return lazy & (step != k.steps - 1) if k.pairs else lazy

  def announce_deferred(self, lin_idx, when):
    """Where when() holds, announces the tile at `lin_idx` of this rank's walk if it went to a
    peer with a deferred signal (`deferred`): at the CTA's next epilogue or after its loop."""
    k = self.k
    if k.d == 1 or not k.hooks.comm:
      return
    step, tile = k.walk(lin_idx)
    for _, offset in k.parts(step, self.wg):
      @pl.when(when() & self.deferred(step, offset))
      def _(offset=offset):
        self.announce(offset, tile)

  def owner_wait(self, tile):
    """Until the own tile `tile`'s D - 1 partials have landed (receive slots; sum_in_output: the
    output; "owner": the sources' staging)."""
    k, d = self.k, self.k.d
    if not (k.hooks.comm and k.hooks.owner_wait):
      return
    with jax.named_scope("owner_wait"):
      if k.owner_pull:  # Each source flags its staged tile, which this CTA then loads.
        for step in range(d - 1):
          k.transport.wait(k.sems, k.rank, k.where.staged(step, tile, self.wg), 1)
      elif k.num_comm:  # Each slot's tiles arrive in the order its comm CTA moves them.
        c, need = tile % k.num_comm, tile // k.num_comm + 1
        for slot in range(d - 1):
          k.transport.wait(k.sems, k.rank, k.where.delivered(slot, c, self.wg), need,
                           local=k.pull)
      else:
        k.transport.wait(k.sems, k.rank, k.where.arrived(tile, self.wg), d - 1)

  def _partials(self, j):
    """Slot j's partial [chunk, n]: this rank's receive slot, or ("owner") the staging of its
    source, which computed it at step arrival_slot(j) (this rank's own staging under the
    "comm" ablation)."""
    k = self.k
    if not k.owner_pull:
      return k.recv_local.at[j]
    step = schedule.arrival_slot(j, k.d)
    return (k.transport.peer(k.stage_gmem, k.rank, schedule.source_offset(step))
            if k.hooks.comm else k.stage_local).at[step]

  def owner_sum(self, acc, tile, slices, emit):
    """The own tile's sum of all D partials, each out_dtype sub-tile handed to emit(i, sub)
    as soon as it is summed (config.owner_sum), the received partials in ring order
    (Rank.slot_order; sum_slot: their sum, one load), then acc: "fp32" in fp32, rounded
    once; "bf16_ring" the unfused path's arithmetic. Emitting as it goes keeps no summed
    tile live beside acc (with D - 1 > 1 partials, holding them spilled registers:
    BUILD_NOTES 2026-12-01)."""
    k = self.k
    out_dtype, recv_stages = k.out.dtype, k.config.recv_stages
    self.owner_wait(tile)
    loads = [(mi, ni, j) for mi, ni in k.epi_tiles for j in k.slot_order]
    if not k.hooks.reduce:
      loads = []
    # With pairs along M one warpgroup of the CTA (rank % 2's) sums and the other only sends,
    # so the summing one takes both warpgroups' receive stages: twice the loads in flight.
    one_sums = k.pairs and not k.split_halves
    stages = _NUM_COMPUTE_WGS * recv_stages if one_sums else recv_stages

    def stage(i):
      """(SMEM slot, barrier) of load i."""
      buf = i % stages
      if one_sums:
        return (self.part_smem.at[buf // recv_stages, buf % recv_stages],
                self.part_barrier.at[buf])
      return self.part_smem.at[self.wg, buf], self.part_barrier.at[self.wg * recv_stages + buf]

    def issue(i):
      mi, ni, j = loads[i]
      sm, sn = k.epi_slices(mi, ni)
      plgpu.copy_gmem_to_smem(self._partials(j).at[slices].at[sm, sn], *stage(i))

    for i in range(min(stages, len(loads))):
      issue(i)
    i = 0
    for e, (mi, ni) in enumerate(k.epi_tiles):
      sm, sn = k.epi_slices(mi, ni)
      own = acc[sm, sn]
      run = None  # bf16_ring: the running bf16 sum (held in f32)
      for _ in range(len(loads) // len(k.epi_tiles)):
        slot, barrier = stage(i)
        plgpu.barrier_wait(barrier)
        if k.hooks.owner_add:
          run = _add_partial(run, slot[...].astype(jnp.float32), ring=k.ring,
                             out_dtype=out_dtype)
        if i + stages < len(loads):
          plgpu.commit_smem()  # Every thread has read `slot` before TMA overwrites it.
          issue(i + stages)
        i += 1
      own = _finish_sum(own, run, ring=k.ring, out_dtype=out_dtype)
      emit(e, own.astype(out_dtype))

  def own(self, acc, tile, slices):
    """The own chunk's tile (`acc()`: its f32 accumulator): the owner's sum of the peers'
    partials into the output, or (D = 1) the tile itself, or (sum_in_output) its own partial
    TMA-added onto the peers' in the output."""
    k = self.k
    out = k.out.at[slices]
    if k.d > 1 and not k.sum_in_output:
      self.owner_sum(acc(), tile, slices,
                     lambda i, sub: self.store_sub(i, sub, self.out_smem, out))
      return
    if k.sum_in_output:  # The ring's last rounded add, by TMA: bf16(peers + bf16(own)).
      self.owner_wait(tile)
    acc = acc().astype(k.out.dtype)
    self.store_tile([acc[k.epi_slices(mi, ni)] for mi, ni in k.epi_tiles], self.out_smem,
                    out, add=self.own_adds)

  def remote(self, acc, step, tile, offset, slices):
    """A peer's tile (the peer at `offset`; `acc()`: its f32 accumulator): staged locally for
    comm CTAs or the owner to move on, or pushed into the owner's receive slot (its output with
    sum_in_output); announced now where its step signals eagerly (or, pairs, beside the own
    chunk), else at the next epilogue."""
    k, d = self.k, self.k.d
    acc = acc().astype(k.part_dtype)
    self.store_tile([acc[k.epi_slices(mi, ni)] for mi, ni in k.epi_tiles], self.send_smem,
                    self.remote_dst(step, offset, slices))
    for o in range(1, d):
      @pl.when(offset == o)
      def _():
        def announce_now(o=o):
          plgpu.wait_smem_to_gmem(0, wait_read_only=False)
          self.announce(o, tile)

        # An eager step (static: remote_step(o)), or a pair's remote half beside
        # the own chunk, waits for its store and announces the tile now (deferred()).
        if k.hooks.comm and schedule.remote_step(o, d) >= k.first_eager:
          announce_now()
        elif k.hooks.comm and k.pairs:
          pl.when(step == k.steps - 1)(announce_now)

  def remote_dst(self, step, offset, slices):
    """Where this warpgroup's remote tile at `step` (for the rank at `offset`; `slices` as in
    tile_slices) goes, as store_sub takes it: the local staging (comm CTAs or the owner move
    it on, at HBM speed) or, among the static peers, the owner's receive slot (its output
    with sum_in_output, where the owner adds its own); this rank's own buffer under the "comm"
    ablation."""
    k = self.k
    if k.staging:
      return k.stage_local.at[step].at[slices]
    whole, local = ((k.out_all, k.out) if k.sum_in_output else (k.recv_gmem, k.recv_local))

    def owner_buffer(o):
      dst = k.transport.peer(whole, k.rank, o) if k.hooks.comm else local
      return (dst if k.sum_in_output else dst.at[schedule.recv_slot(o)]).at[slices]

    return [(offset == o, functools.partial(owner_buffer, o)) for o in range(1, k.d)]

  def exit_handshake(self, cta_index, num_compute):
    """"owner": this warpgroup reads no peer any more (every load was waited on before its
    sum); a rank exits only once its peers are done with its staging (XLA may reuse it)."""
    k = self.k

    @pl.when(self.wg < _NUM_COMPUTE_WGS)
    def _():
      for o in range(1, k.d):
        k.transport.signal(k.sems, k.rank, o, k.where.done())

    @pl.when((cta_index == 0) & (self.wg == 0))
    @jax.named_scope("exit_wait")
    def _():
      k.transport.wait(k.sems, k.rank, k.where.done(),
                       schedule.pull_done_target(k.d, num_compute))
