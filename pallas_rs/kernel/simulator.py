"""The schedule of schedule.py run as data: every CTA of every rank as a sequential program
of events mirroring body.py and comm.py, interleaved round-robin (`simulate`), so that the tests
can check every variant for deadlock, unwritten reads and order without a GPU.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from pallas_rs.kernel.schedule import (COMM_SIGNAL_BATCH, COMM_SIGNAL_LAG, NUM_COMPUTE_WGS,
                                       first_eager_step, num_steps, own_step, pull_done_target,
                                       arrival_slot, recv_slot, remote_step, ring_slots,
                                       source_offset,
                                       step_and_tile, wg_dst)


@dataclasses.dataclass(frozen=True)
class Event:
  """One action of a CTA, in program order.

  kind: "compute" (mainloop of a tile), "store" (TMA store of a tile to `dst`, slot `slot`),
    "signal" (one increment of `dst`'s semaphore `(tile, wg)` per compute warpgroup),
    "wait" (own chunk: wait until semaphore `(tile, wg)` reaches `target`),
    "reduce" (read slots 0..D-2 of `tile` and write the output tile),
    "stage" (with comm CTAs: TMA store of a remote tile into the rank's own staging slot
      `slot`, the step), "signal_staged" (one increment of the rank's staged semaphore
      `(slot, tile, wg)` per compute warpgroup), "wait_staged" (a comm CTA waits for it),
      "pull" (an owner's comm CTA reads source `dst`'s staged tile of `step` into `slot`).
  With chunk pairs (group 2) the two warpgroups of a tile have different destinations: each
  store, signal, wait and reduce names its warpgroup. (Pairs along N, whose warpgroups each
  send one 64-row half and sum the other, remote half first, run the same events: `wg` then
  names the half; the owner's semaphore of a (tile, warpgroup) counts the same signals.)
  """
  kind: str
  rank: int
  cta: int
  step: int
  tile: int
  dst: int
  slot: int = -1
  target: int = 0
  wg: int = -1  # the compute warpgroup it concerns; -1: both (the same tile, the same peer)


def cta_tiles(cta: int, num_ctas: int, num_devices: int, tiles_per_chunk: int) -> list[int]:
  return list(range(cta, num_devices * tiles_per_chunk, num_ctas))


def cta_program(rank: int, cta: int, *, num_ctas: int, num_devices: int,
                tiles_per_chunk: int, eager_signal_steps: int = 0,
                comm_ctas: int = 0, pull: bool = False, group: int = 1,
                interleave: bool = False, owner_pull: bool = False) -> list[Event]:
  """The ordered events of CTA `cta` of `num_ctas` (a rank's whole grid), mirroring body.py.
  Events name the CTA by its grid index; a compute CTA picks its tiles by its index among the
  compute CTAs. `group`: chunks per CTA tile (`chunk_group`; 2 only with the direct push);
  `interleave`: the walk of step_and_tile; `owner_pull` (comm_mode "owner", no comm CTAs):
  remote tiles staged and flagged to their owner, whose own tile waits for each source's flag
  and pulls the partials itself, then every compute CTA tells the peers it is done reading
  and compute CTA 0 waits until the peers are done with its staging."""
  d = num_devices
  owner_pull = owner_pull and d > 1
  staged = (bool(comm_ctas) or owner_pull) and d > 1
  if staged and cta < comm_ctas:
    program = _pull_program if pull else _comm_program
    return program(rank, cta, comm_ctas=comm_ctas, num_devices=d,
                   tiles_per_chunk=tiles_per_chunk)
  first = comm_ctas if staged else 0  # Compute CTAs are the grid's CTAs first, first + 1, ...
  first_eager = first_eager_step(d, eager_signal_steps)
  last = num_steps(d, group) - 1
  # A remote tile's signal waits for the CTA's next tile unless its chunk signals eagerly, or
  # (pairs) it shares its tile with the own chunk: the next tile's mainloop needs the own
  # warpgroup, which waits for the peers; their partner warpgroups, for this signal.
  def deferred(e):
    offset = (e.dst - rank) % d
    return remote_step(offset, d) < first_eager and not (group == 2 and e.step == last)

  def announce(e):
    if staged:
      # Push: this rank's comm CTAs move it; pull: the owner's do; owner pull: the owner.
      owner = e.dst if pull or owner_pull else rank
      return Event("signal_staged", rank, cta, e.step, e.tile, owner, e.slot)
    return Event("signal", rank, cta, e.step, e.tile, e.dst, e.slot, wg=e.wg)

  events, prev = [], []
  for lin in cta_tiles(cta - first, num_ctas - first, num_steps(d, group), tiles_per_chunk):
    step, tile = step_and_tile(lin, tiles_per_chunk, last + 1, interleave)
    events.append(Event("compute", rank, cta, step, tile, wg_dst(rank, step, 0, d, group)))
    events += [announce(e) for e in prev if deferred(e)]
    prev = []
    # The warpgroups that share a destination: both (group 1), or each on its own (pairs; the
    # remote one first: they run concurrently and it never waits).
    parts = [-1] if group == 1 else sorted(
        (0, 1), key=lambda wg: wg_dst(rank, step, wg, d, group) == rank)
    for wg in parts:
      dst = wg_dst(rank, step, max(wg, 0), d, group)
      if dst == rank:  # The own chunk.
        if owner_pull:  # Each source's flag, then its staged partial into the slot naming it.
          for s in range(own_step(d)):
            o = source_offset(s)
            events.append(Event("wait_staged", rank, cta, s, tile, rank, s, target=1))
            events.append(Event("pull", rank, cta, s, tile, (rank + o) % d,
                                arrival_slot(s, d)))
        elif staged:  # One wait per slot: tile // n + 1 tiles delivered by comm CTA tile % n.
          events += [Event("wait_delivered", rank, cta, step, tile, rank, j,
                           target=tile // comm_ctas + 1) for j in range(d - 1)]
        elif d > 1:
          events.append(Event("wait", rank, cta, step, tile, rank, target=d - 1, wg=wg))
        events.append(Event("reduce", rank, cta, step, tile, rank, wg=wg))
        continue
      # Staging is indexed by the step, a receive slot by the source's offset.
      slot = step if staged else recv_slot((dst - rank) % d)
      e = Event("stage" if staged else "store", rank, cta, step, tile, dst, slot, wg=wg)
      events.append(e)
      prev.append(e)
      if not deferred(e):
        events.append(announce(e))
  events += [announce(e) for e in prev if deferred(e)]
  if owner_pull:
    events += [Event("signal_done", rank, cta, 0, 0, (rank + o) % d) for o in range(1, d)]
    if cta == first:
      events.append(Event("wait_done", rank, cta, 0, 0, rank,
                          target=pull_done_target(d, num_ctas - first)))
  return events


def _comm_program(rank: int, cta: int, *, comm_ctas: int, num_devices: int,
                  tiles_per_chunk: int) -> list[Event]:
  """Comm CTA `cta`: per remote step, its tiles in order, each staged-wait then store; tiles
  that have landed (COMM_SIGNAL_LAG behind) announced COMM_SIGNAL_BATCH at a time ("deliver",
  `target` = the increment), the rest after the step's last store."""
  d = num_devices
  events = []
  for step in range(own_step(d)):
    dst = wg_dst(rank, step, 0, d)
    slot = recv_slot((dst - rank) % d)
    for q, tile in enumerate(range(cta, tiles_per_chunk, comm_ctas)):
      events.append(Event("wait_staged", rank, cta, step, tile, rank, step, target=1))
      events.append(Event("store", rank, cta, step, tile, dst, slot))
      events += _deliveries(rank, cta, step, dst, slot, q, tiles_per_chunk, comm_ctas)
  return events


def _deliveries(rank: int, cta: int, step: int, owner: int, slot: int, q: int,
                tiles_per_chunk: int, comm_ctas: int) -> list[Event]:
  """The "deliver" events comm CTA `cta` emits after copying its q-th tile of a step (comm.py's
  _announce_landed and _announce_rest): COMM_SIGNAL_BATCH tiles at a time, COMM_SIGNAL_LAG
  behind; after its last tile, the rest."""
  n = len(range(cta, tiles_per_chunk, comm_ctas))
  landed = q - COMM_SIGNAL_LAG + 1
  batched = max(n - COMM_SIGNAL_LAG, 0) // COMM_SIGNAL_BATCH * COMM_SIGNAL_BATCH
  events = []
  if landed > 0 and landed % COMM_SIGNAL_BATCH == 0:
    events.append(Event("deliver", rank, cta, step, cta, owner, slot, target=COMM_SIGNAL_BATCH))
  if q == n - 1 and n > batched:
    events.append(Event("deliver", rank, cta, step, cta, owner, slot, target=n - batched))
  return events


def _pull_program(rank: int, cta: int, *, comm_ctas: int, num_devices: int,
                  tiles_per_chunk: int) -> list[Event]:
  """Pulling comm CTA `cta` of owner `rank`: per remote step s, its tiles of the chunk that
  the source rank + s + 1 staged at its step s: wait for the source's flag, pull (read the
  source's staging, land in the local slot of that source), announce locally as _comm_program
  does; then tell every peer it is done reading, and CTA 0 waits until all peers are done with
  its own."""
  d = num_devices
  events = []
  for step in range(own_step(d)):
    o = source_offset(step)
    src, slot = (rank + o) % d, arrival_slot(step, d)
    for q, tile in enumerate(range(cta, tiles_per_chunk, comm_ctas)):
      events.append(Event("wait_staged", rank, cta, step, tile, rank, step, target=1))
      events.append(Event("pull", rank, cta, step, tile, src, slot))
      events += _deliveries(rank, cta, step, rank, slot, q, tiles_per_chunk, comm_ctas)
  events += [Event("signal_done", rank, cta, 0, 0, (rank + o) % d) for o in range(1, d)]
  if cta == 0:
    events.append(Event("wait_done", rank, cta, 0, 0, rank,
                        target=pull_done_target(d, comm_ctas)))
  return events


def simulate(*, num_ctas: int, num_devices: int, tiles_per_chunk: int,
             eager_signal_steps: int = 0, comm_ctas: int = 0,
             pull: bool = False, group: int = 1, interleave: bool = False,
             ring_chain: bool = False, owner_pull: bool = False) -> dict[str, Any]:
  """Runs every CTA of every rank as a sequential process, round-robin.

  Models the co-resident persistent grid the kernel requires (fused.check_supported keeps
  num_sms within the GPU). Returns the final semaphore values (the owners' `(rank, tile, wg)`
  and, with comm CTAs, the staged `("staged", rank, slot, tile, wg)`) and the event order.
  Raises RuntimeError on deadlock (no CTA can make progress), on a read of an unwritten slot
  or on a push of a tile that was not staged; with `ring_chain` (pulling comm CTAs adding the
  partials by TMA, Config.tma_add at D > 2: into the output, or the fp32 sum slot), on a
  partial pulled before those before it in ring order have landed (the adds would not be in
  ring order).
  """
  d = num_devices
  if comm_ctas and d > 1 and comm_ctas >= num_ctas:
    raise ValueError(f"{comm_ctas=} leaves no compute CTA among {num_ctas=}")
  done_target = pull_done_target(d, num_ctas if owner_pull else comm_ctas)
  programs = {(r, c): cta_program(r, c, num_ctas=num_ctas, num_devices=d,
                                  tiles_per_chunk=tiles_per_chunk,
                                  eager_signal_steps=eager_signal_steps, comm_ctas=comm_ctas,
                                  pull=pull, group=group, interleave=interleave,
                                  owner_pull=owner_pull)
              for r in range(d) for c in range(num_ctas)}
  pcs = {key: 0 for key in programs}
  sems: dict[tuple, int] = {}
  landed: set[tuple[int, int, int, int]] = set()  # (dst, slot, tile, wg) stores that completed
  staged: set[tuple[int, int, int]] = set()  # (rank, step, tile) tiles in staging
  trace = []
  pending = sum(len(p) for p in programs.values())
  wgs = range(NUM_COMPUTE_WGS)
  wgs_of = lambda ev: wgs if ev.wg < 0 else (ev.wg,)
  while pending:
    progressed = False
    for key, prog in programs.items():
      while pcs[key] < len(prog):
        ev = prog[pcs[key]]
        if ev.kind == "wait":
          if any(sems.get((ev.rank, ev.tile, wg), 0) < ev.target for wg in wgs_of(ev)):
            break
        elif ev.kind == "wait_delivered":
          c = ev.tile % comm_ctas
          if any(sems.get(("delivered", ev.rank, ev.slot, c, wg), 0) < ev.target for wg in wgs):
            break
        elif ev.kind == "wait_done":
          if sems.get(("done", ev.rank), 0) < ev.target:
            break
        elif ev.kind == "pull":
          if (ev.dst, ev.step, ev.tile) not in staged:
            raise RuntimeError(f"rank {ev.rank} pulls tile {ev.tile} of step {ev.step} from "
                               f"rank {ev.dst} before it was staged")
          order = ring_slots(d)
          if ring_chain and any((ev.rank, j, ev.tile, wg) not in landed
                                for j in order[:order.index(ev.slot)] for wg in wgs):
            raise RuntimeError(f"rank {ev.rank} adds slot {ev.slot} of tile {ev.tile} before "
                               "the slots before it in ring order")
          if ("done", ev.dst) in sems and sems[("done", ev.dst)] >= done_target:
            raise RuntimeError(f"rank {ev.rank} reads rank {ev.dst}'s staging after it exited")
          landed.update((ev.rank, ev.slot, ev.tile, wg) for wg in wgs)
        elif ev.kind == "signal_done":
          sems[("done", ev.dst)] = sems.get(("done", ev.dst), 0) + len(wgs)
        elif ev.kind == "wait_staged":
          if any(sems.get(("staged", ev.rank, ev.slot, ev.tile, wg), 0) < ev.target
                 for wg in wgs):
            break
        elif ev.kind == "reduce":
          for slot in range(d - 1):
            if any((ev.rank, slot, ev.tile, wg) not in landed for wg in wgs_of(ev)):
              raise RuntimeError(f"rank {ev.rank} reads slot {slot} of tile {ev.tile} "
                                 "before it was written")
        elif ev.kind == "stage":
          staged.add((ev.rank, ev.slot, ev.tile))
        elif ev.kind == "store" and ev.slot >= 0:
          if comm_ctas and d > 1 and (ev.rank, ev.step, ev.tile) not in staged:
            raise RuntimeError(f"rank {ev.rank} pushes tile {ev.tile} of step {ev.step} "
                               "before it was staged")
          # The store lands before its signal (wait_smem_to_gmem precedes the signal).
          landed.update((ev.dst, ev.slot, ev.tile, wg) for wg in wgs_of(ev))
        elif ev.kind == "signal":
          for wg in wgs_of(ev):
            if (ev.dst, ev.slot, ev.tile, wg) not in landed:
              raise RuntimeError(f"rank {ev.rank} signals tile {ev.tile} before it landed")
            sems[(ev.dst, ev.tile, wg)] = sems.get((ev.dst, ev.tile, wg), 0) + 1
        elif ev.kind == "deliver":
          for wg in wgs:
            k = ("delivered", ev.dst, ev.slot, ev.cta, wg)
            first = sems.get(k, 0)
            for q in range(first, first + ev.target):
              if (ev.dst, ev.slot, ev.cta + q * comm_ctas, wg) not in landed:
                raise RuntimeError(f"rank {ev.rank} delivers tile {ev.cta + q * comm_ctas} "
                                   "before it landed")
            sems[k] = first + ev.target
        elif ev.kind == "signal_staged":
          for wg in wgs:
            k = ("staged", ev.dst, ev.slot, ev.tile, wg)
            sems[k] = sems.get(k, 0) + 1
        trace.append(ev)
        pcs[key] += 1
        pending -= 1
        progressed = True
    if not progressed:
      stuck = {k: programs[k][pcs[k]] for k in programs if pcs[k] < len(programs[k])}
      raise RuntimeError(f"deadlock: {len(stuck)} CTAs blocked, e.g. {next(iter(stuck.values()))}")
  return {"semaphores": sems, "trace": trace}
