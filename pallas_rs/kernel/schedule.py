"""The communication schedule as data, shared by the kernel and the tests.

Every rank runs the same persistent loop over `num_devices * tiles_per_chunk` linear tile
indices, strided over its CTAs (CTA `c` of `num_ctas` takes `c, c + num_ctas, ...`). Linear
index `i` belongs to step `s = i // tiles_per_chunk` and tile `t = i % tiles_per_chunk` of that
step's chunk. At step `s` rank `r` computes the chunk of destination `(r + s + 1) % D`: the next
rank first, its own chunk last (the stagger). A tile of a peer's chunk is TMA-stored into the
peer's receive slot `s` (so slot `j` of rank `r` holds the partial of source `(r - j - 1) % D`)
and announced on the peer's semaphore `(t, wg)` once the store has landed. The own chunk's
epilogue waits for `D - 1` signals on `(t, wg)`, then adds slots `0 .. D-2` in that order to
its fp32 accumulator and rounds once. With `interleave` (Config.interleave_steps, the default
where a chunk is one row of CTA tiles) the remote steps are walked tile by tile instead, step
fastest, and the own step still last (`step_and_tile`): same events, another order.

A signal for a remote tile is sent lazily: at the start of the epilogue of the CTA's next tile
(the store has had a whole mainloop to land), or after the loop for the CTA's last tile. The
last `eager_signal_steps` remote steps instead wait for their store right away and signal at
once (`first_eager_step`): the owner, who computes its own chunk next, waits less.

With `comm_ctas` > 0 (kernel v3, docs/design.md section 3.2) the first `comm_ctas` CTAs of a
rank compute nothing: the compute CTAs (the others, renumbered from 0) store each remote tile
into the rank's own staging slot `s` and flag it (lazily or eagerly, as above). Push: the flag
is local and comm CTA `c` of the source takes the tiles `c, c + comm_ctas, ...` of each remote
step in order, copies each into the owner's receive slot and announces landed tiles in batches
(`COMM_SIGNAL_LAG` tiles behind, `COMM_SIGNAL_BATCH` per signal) on the owner's counter
`(slot, c)`. Pull: the flag goes to the owner, whose comm CTA `c` copies the tiles from the
source's staging into its own slot and announces them locally, in the same batches; a done
handshake keeps every rank alive until its peers have finished reading its staging buffer.

`SemLayout` names the semaphores; `simulate` checks every variant.

The functions below accept Python ints and traced int32 scalars alike.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

NUM_COMPUTE_WGS = 2
# Tiles a comm warpgroup keeps in flight before it waits for the oldest to land and signals it.
COMM_SIGNAL_LAG = 4
# Landed tiles a comm warpgroup announces with one signal (each costs ~0.7 us: it waits for the
# stores before it; BUILD_NOTES 2026-12-01).
COMM_SIGNAL_BATCH = 4


@dataclasses.dataclass(frozen=True)
class SemLayout:
  """Where each semaphore lives in a rank's `[rows, cols, wg]` array (transport.py).

  Direct push (no comm CTAs): `arrived(tile)` = (0, tile), D - 1 signals per tile, one per
  peer. With comm CTAs: `delivered(slot, c)` = (slot, c) counts the tiles of receive slot
  `slot` that the source's comm CTA c has landed here, in its order c, c + n, ... (announced in
  batches), so tile t has arrived once entry (slot, t % n) reaches t // n + 1; `staged(step,
  tile)` = (D - 1 + step, tile) flags a staged remote tile: the rank's own (push from
  staging), or, with `pull`, the peer's that computed this rank's chunk at `step` (signalled
  over NVLink); then `done()` counts the peers done reading this rank's staging buffer.
  """
  num_devices: int
  tiles: int
  comm_ctas: int
  pull: bool = False

  @property
  def shape(self) -> tuple[int, int]:
    if not self.comm_ctas:
      return 1, self.tiles
    rows = 2 * (self.num_devices - 1) + (1 if self.pull else 0)
    return rows, max(self.tiles, self.comm_ctas)

  def done(self):
    """Pull: the peers' comm warpgroups that finished reading this rank's staging buffer."""
    return 2 * (self.num_devices - 1), 0, 0

  def arrived(self, tile, wg):
    return 0, tile, wg

  def delivered(self, slot: int, comm_cta, wg):
    return slot, comm_cta, wg

  def staged(self, step: int, tile, wg):
    return self.num_devices - 1 + step, tile, wg


def step_and_tile(lin_idx: Any, tiles_per_chunk: int, steps: int = 1,
                  interleave: bool = False) -> tuple[Any, Any]:
  """(step, tile) of linear index `lin_idx` in a rank's walk over `steps` steps.

  Step-major by default: step lin // tiles_per_chunk. `interleave` (Config.interleave_steps):
  the remote steps (all but the last) tile by tile, step fastest (lin -> step lin % (steps - 1),
  tile lin // (steps - 1)), then the own step as before; the own chunk stays last, and a wave
  of CTAs covers 1 / (steps - 1) as many tiles of each step, so it reads as much fewer columns
  of w where a step is one row of tiles (BUILD_NOTES 2026-12-01, eighth session)."""
  if not interleave or steps <= 2:
    return lin_idx // tiles_per_chunk, lin_idx % tiles_per_chunk
  remote = (steps - 1) * tiles_per_chunk
  own_tile = lin_idx - remote
  if isinstance(lin_idx, int):
    return ((lin_idx % (steps - 1), lin_idx // (steps - 1)) if lin_idx < remote
            else (steps - 1, own_tile))
  is_remote = lin_idx < remote
  return (jnp.where(is_remote, lin_idx % (steps - 1), steps - 1),
          jnp.where(is_remote, lin_idx // (steps - 1), own_tile))


def interleave_pays(chunk: int, cta_tile_m: int, num_devices: int) -> bool:
  """Whether the interleaved walk (step_and_tile) is the default: D > 2 and a chunk of one row
  of CTA tiles, where the step-major walk sweeps all of w in every wave (a D = 8 M = 512
  rank's GEMM core 17-22% faster alone; two or more rows: no gain; BUILD_NOTES 2026-12-01,
  eighth session)."""
  return num_devices > 2 and chunk == cta_tile_m


def chunk_group(chunk: int, tile_m: int, wg_along_m: bool, num_devices: int) -> int:
  """Row chunks one CTA tile spans: 2 where the warpgroups stack along M and each is a whole
  chunk high (a 128-row tile over the 64-row chunks of ranks 2p and 2p + 1, one warpgroup
  each: "pairs", D = 8 at M = 512; D even), else 1."""
  pairs = wg_along_m and tile_m == chunk and num_devices % 2 == 0
  return 2 if pairs else 1


def num_steps(num_devices: int, group: int = 1) -> int:
  """Steps of a rank's walk: one per chunk group, its own group last."""
  return num_devices // group


def tile_grid(chunk: int, n: int, cta_m: int, cta_n: int, group: int = 1) -> tuple[int, int]:
  """(row blocks, column blocks) of CTA tiles over one step's rows (a chunk, or `group`
  chunks: pairs) and n columns."""
  return group * chunk // cta_m, n // cta_n


def total_tiles(chunk: int, n: int, cta_m: int, cta_n: int, num_devices: int,
                group: int = 1) -> int:
  """Linear tiles of a rank's walk: num_steps x one step's tile_grid."""
  m_iters, n_iters = tile_grid(chunk, n, cta_m, cta_n, group)
  return num_steps(num_devices, group) * m_iters * n_iters


def wg_dst(rank: Any, step: Any, wg: Any, num_devices: int, group: int = 1) -> Any:
  """Destination rank of warpgroup `wg`'s tile at `step`: chunk group (rank // g + step + 1)
  mod D / g (the stagger), and in it the warpgroup's own chunk (g = 2) or the group's one
  chunk (g = 1, both warpgroups: `(rank + step + 1) % D`)."""
  groups = num_devices // group
  first = (rank // group + step + 1) % groups * group
  return first + wg if group == 2 else first


def wg_offset(rank: Any, step: Any, wg: Any, num_devices: int, group: int = 1) -> Any:
  """Offset of `wg_dst` from `rank` (0: the own chunk; o > 0: receive slot o - 1)."""
  return (wg_dst(rank, step, wg, num_devices, group) - rank) % num_devices


def recv_slot(step: int) -> int:
  """Receive slot written at a remote `step` (equal to offset - 1)."""
  return step


def source_of_slot(rank: int, slot: int, num_devices: int) -> int:
  return (rank - slot - 1) % num_devices


def ring_slots(num_devices: int) -> tuple[int, ...]:
  """Receive slots in NCCL's ring order for owner_sum="bf16_ring": the unfused reduce-scatter
  of chunk r adds the partials of sources r+1, r+2, ..., r+D-1 (the first one is the initial
  running sum), then r's own; source r+i sits in slot D-1-i (source_of_slot)."""
  return tuple(range(num_devices - 2, -1, -1))


def own_step(num_devices: int) -> int:
  return num_devices - 1


def first_eager_step(num_devices: int, eager_signal_steps: int) -> int:
  """Remote steps >= this signal eagerly; own_step (no remote step) when none does."""
  return max(0, own_step(num_devices) - eager_signal_steps)


@dataclasses.dataclass(frozen=True)
class Event:
  """One action of a CTA, in program order.

  kind: "compute" (mainloop of a tile), "store" (TMA store of a tile to `dst`, slot `slot`),
    "signal" (one increment of `dst`'s semaphore `(tile, wg)` per compute warpgroup),
    "wait" (own chunk: wait until semaphore `(tile, wg)` reaches `target`),
    "reduce" (read slots 0..D-2 of `tile` and write the output tile),
    "stage" (with comm CTAs: TMA store of a remote tile into the rank's own staging slot
      `slot`), "signal_staged" (one increment of the rank's staged semaphore
      `(slot, tile, wg)` per compute warpgroup), "wait_staged" (a comm CTA waits for it).
  With chunk pairs (group 2) the two warpgroups of a tile have different destinations: each
  store, signal, wait and reduce names its warpgroup.
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
                interleave: bool = False) -> list[Event]:
  """The ordered events of CTA `cta` of `num_ctas` (a rank's whole grid), mirroring body.py.
  Events name the CTA by its grid index; a compute CTA picks its tiles by its index among the
  compute CTAs. `group`: chunks per CTA tile (`chunk_group`; 2 only with the direct push);
  `interleave`: the walk of step_and_tile."""
  d = num_devices
  staged = bool(comm_ctas) and d > 1
  if staged and cta < comm_ctas:
    program = _pull_program if pull else _comm_program
    return program(rank, cta, comm_ctas=comm_ctas, num_devices=d,
                   tiles_per_chunk=tiles_per_chunk)
  first = comm_ctas if staged else 0  # Compute CTAs are the grid's CTAs first, first + 1, ...
  first_eager = first_eager_step(d, eager_signal_steps)
  last = num_steps(d, group) - 1
  # A remote tile's signal waits for the CTA's next tile unless its slot signals eagerly, or
  # (pairs) it shares its tile with the own chunk: the next tile's mainloop needs the own
  # warpgroup, which waits for the peers; their partner warpgroups, for this signal.
  deferred = lambda e: 0 <= e.slot < first_eager and not (group == 2 and e.step == last)

  def announce(e):
    if staged:
      # Push: this rank's comm CTAs move it; pull: the owner's do.
      return Event("signal_staged", rank, cta, e.step, e.tile, e.dst if pull else rank, e.slot)
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
      slot = (dst - rank) % d - 1
      if slot < 0:  # The own chunk.
        if staged:  # One wait per slot: tile // n + 1 tiles delivered by comm CTA tile % n.
          events += [Event("wait_delivered", rank, cta, step, tile, rank, j,
                           target=tile // comm_ctas + 1) for j in range(d - 1)]
        elif d > 1:
          events.append(Event("wait", rank, cta, step, tile, rank, target=d - 1, wg=wg))
        events.append(Event("reduce", rank, cta, step, tile, rank, wg=wg))
        continue
      e = Event("stage" if staged else "store", rank, cta, step, tile, dst, slot, wg=wg)
      events.append(e)
      prev.append(e)
      if not deferred(e):
        events.append(announce(e))
  events += [announce(e) for e in prev if deferred(e)]
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
    slot = recv_slot(step)
    for q, tile in enumerate(range(cta, tiles_per_chunk, comm_ctas)):
      events.append(Event("wait_staged", rank, cta, step, tile, rank, slot, target=1))
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
  the source rank - s - 1 staged at its step s: wait for the source's flag, pull (read the
  source's staging, land in local slot s), announce locally as _comm_program does; then
  tell every peer it is done reading, and CTA 0 waits until all peers are done with its own."""
  d = num_devices
  events = []
  for step in range(own_step(d)):
    src = (rank - step - 1) % d
    slot = recv_slot(step)
    for q, tile in enumerate(range(cta, tiles_per_chunk, comm_ctas)):
      events.append(Event("wait_staged", rank, cta, step, tile, rank, slot, target=1))
      events.append(Event("pull", rank, cta, step, tile, src, slot))
      events += _deliveries(rank, cta, step, rank, slot, q, tiles_per_chunk, comm_ctas)
  events += [Event("signal_done", rank, cta, 0, 0, (rank + o) % d) for o in range(1, d)]
  if cta == 0:
    events.append(Event("wait_done", rank, cta, 0, 0, rank,
                        target=pull_done_target(d, comm_ctas)))
  return events


def pull_done_target(num_devices: int, comm_ctas: int) -> int:
  """Pull: the "done" signals a rank waits for before it exits, one from each comm warpgroup
  of each peer, once that warpgroup has finished reading the rank's staging buffer."""
  return (num_devices - 1) * comm_ctas * NUM_COMPUTE_WGS


def comm_prefetch(sets: int) -> tuple[int, int]:
  """(prefetch, reuse_wait) of a pulling comm warpgroup with `sets` SMEM buffers (comm.py).

  Block j's remote load goes into buffer j % sets, `prefetch` blocks ahead of its local store;
  before it, the warpgroup waits until at most `reuse_wait` of its TMA stores may still read
  SMEM, so that the store of the buffer's previous block (j - sets) has read it
  (tests/test_schedule.py checks this against a model of the store queue)."""
  if sets < 1:
    raise ValueError(f"{sets=} must be >= 1")
  prefetch = max(1, sets - 1)
  return prefetch, sets - prefetch


def comm_reuse_wait(sets: int) -> int:
  """TMA stores a pushing comm warpgroup may leave unread before it refills a buffer (comm.py):
  block j goes into buffer j % sets, so the store of block j - sets, the oldest of the last
  `sets`, must have read it (tests/test_schedule.py checks this against a model of the store
  queue)."""
  if sets < 1:
    raise ValueError(f"{sets=} must be >= 1")
  return sets - 1


def simulate(*, num_ctas: int, num_devices: int, tiles_per_chunk: int,
             eager_signal_steps: int = 0, comm_ctas: int = 0,
             pull: bool = False, group: int = 1, interleave: bool = False) -> dict[str, Any]:
  """Runs every CTA of every rank as a sequential process, round-robin.

  Models the co-resident persistent grid the kernel requires (fused.check_supported keeps
  num_sms within the GPU). Returns the final semaphore values (the owners' `(rank, tile, wg)`
  and, with comm CTAs, the staged `("staged", rank, slot, tile, wg)`) and the event order.
  Raises RuntimeError on deadlock (no CTA can make progress), on a read of an unwritten slot
  or on a push of a tile that was not staged.
  """
  d = num_devices
  if comm_ctas and d > 1 and comm_ctas >= num_ctas:
    raise ValueError(f"{comm_ctas=} leaves no compute CTA among {num_ctas=}")
  done_target = pull_done_target(d, comm_ctas)
  programs = {(r, c): cta_program(r, c, num_ctas=num_ctas, num_devices=d,
                                  tiles_per_chunk=tiles_per_chunk,
                                  eager_signal_steps=eager_signal_steps, comm_ctas=comm_ctas,
                                  pull=pull, group=group, interleave=interleave)
              for r in range(d) for c in range(num_ctas)}
  pcs = {key: 0 for key in programs}
  sems: dict[tuple, int] = {}
  landed: set[tuple[int, int, int, int]] = set()  # (dst, slot, tile, wg) stores that completed
  staged: set[tuple[int, int, int]] = set()  # (rank, slot, tile) tiles in staging
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
          if (ev.dst, ev.slot, ev.tile) not in staged:
            raise RuntimeError(f"rank {ev.rank} pulls tile {ev.tile} of slot {ev.slot} from "
                               f"rank {ev.dst} before it was staged")
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
          if comm_ctas and d > 1 and (ev.rank, ev.slot, ev.tile) not in staged:
            raise RuntimeError(f"rank {ev.rank} pushes tile {ev.tile} of slot {ev.slot} "
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
