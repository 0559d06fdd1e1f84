"""The communication schedule as data, shared by the kernel and the tests.

Every rank runs the same persistent loop over `num_devices * tiles_per_chunk` linear tile
indices, strided over its CTAs (CTA `c` of `num_ctas` takes `c, c + num_ctas, ...`). Linear
index `i` belongs to step `s = i // tiles_per_chunk` and tile `t = i % tiles_per_chunk` of that
step's chunk. At step `s` rank `r` computes the chunk of destination `(r + s + 1) % D`: the next
rank first, its own chunk last (the stagger). A tile of a peer's chunk is TMA-stored into the
peer's receive slot `s` (so slot `j` of rank `r` holds the partial of source `(r - j - 1) % D`)
and announced on the peer's semaphore `(t, wg)` once the store has landed. The own chunk's
epilogue waits for `D - 1` signals on `(t, wg)`, then adds slots `0 .. D-2` in that order to
its fp32 accumulator and rounds once.

A signal for a remote tile is sent lazily: at the start of the epilogue of the CTA's next tile
(the store has had a whole mainloop to land), or after the loop for the CTA's last tile. The
last `eager_signal_steps` remote steps instead wait for their store right away and signal at
once (`first_eager_step`): the owner, who computes its own chunk next, waits less.

The functions below accept Python ints and traced int32 scalars alike.
"""
from __future__ import annotations

import dataclasses
from typing import Any

NUM_COMPUTE_WGS = 2


def step_and_tile(lin_idx: Any, tiles_per_chunk: int) -> tuple[Any, Any]:
  return lin_idx // tiles_per_chunk, lin_idx % tiles_per_chunk


def dst_offset(step: Any, num_devices: int) -> Any:
  """Offset `o` of the destination `(rank + o) % D` computed at `step`; 0 is the own chunk."""
  return (step + 1) % num_devices


def recv_slot(step: int) -> int:
  """Receive slot written at a remote `step` (equal to offset - 1)."""
  return step


def source_of_slot(rank: int, slot: int, num_devices: int) -> int:
  return (rank - slot - 1) % num_devices


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
    "reduce" (read slots 0..D-2 of `tile` and write the output tile).
  """
  kind: str
  rank: int
  cta: int
  step: int
  tile: int
  dst: int
  slot: int = -1
  target: int = 0


def cta_tiles(cta: int, num_ctas: int, num_devices: int, tiles_per_chunk: int) -> list[int]:
  return list(range(cta, num_devices * tiles_per_chunk, num_ctas))


def cta_program(rank: int, cta: int, *, num_ctas: int, num_devices: int,
                tiles_per_chunk: int, eager_signal_steps: int = 0) -> list[Event]:
  """The ordered events of one CTA, mirroring kernel.py's loop body."""
  d = num_devices
  first_eager = first_eager_step(d, eager_signal_steps)
  deferred = lambda e: e is not None and e.step < first_eager  # A remote, lazy signal.
  events = []
  prev = None
  for lin in cta_tiles(cta, num_ctas, d, tiles_per_chunk):
    step, tile = step_and_tile(lin, tiles_per_chunk)
    dst = (rank + dst_offset(step, d)) % d
    events.append(Event("compute", rank, cta, step, tile, dst))
    if deferred(prev):
      events.append(Event("signal", rank, cta, prev.step, prev.tile, prev.dst, prev.slot))
    if step == own_step(d):
      if d > 1:
        events.append(Event("wait", rank, cta, step, tile, rank, target=d - 1))
      events.append(Event("reduce", rank, cta, step, tile, rank))
      prev = Event("store", rank, cta, step, tile, rank)
    else:
      prev = Event("store", rank, cta, step, tile, dst, recv_slot(step))
      events.append(prev)
      if not deferred(prev):
        events.append(Event("signal", rank, cta, step, tile, dst, prev.slot))
  if deferred(prev):
    events.append(Event("signal", rank, cta, prev.step, prev.tile, prev.dst, prev.slot))
  return events


def rank_programs(rank: int, *, num_ctas: int, num_devices: int, tiles_per_chunk: int,
                  eager_signal_steps: int = 0) -> list[list[Event]]:
  return [cta_program(rank, c, num_ctas=num_ctas, num_devices=num_devices,
                      tiles_per_chunk=tiles_per_chunk, eager_signal_steps=eager_signal_steps)
          for c in range(num_ctas)]


def simulate(*, num_ctas: int, num_devices: int, tiles_per_chunk: int,
             eager_signal_steps: int = 0) -> dict[str, Any]:
  """Runs every CTA of every rank as a sequential process, round-robin.

  Models the co-resident persistent grid the kernel requires (fused.check_supported keeps
  num_sms within the GPU). Returns the final semaphore values and the event order. Raises
  RuntimeError on deadlock (no CTA can make progress) or on a read of an unwritten slot.
  """
  d = num_devices
  programs = {(r, c): prog for r in range(d)
              for c, prog in enumerate(rank_programs(
                  r, num_ctas=num_ctas, num_devices=d, tiles_per_chunk=tiles_per_chunk,
                  eager_signal_steps=eager_signal_steps))}
  pcs = {key: 0 for key in programs}
  sems: dict[tuple[int, int, int], int] = {}
  landed: set[tuple[int, int, int]] = set()  # (dst, slot, tile) stores that completed
  trace = []
  pending = sum(len(p) for p in programs.values())
  while pending:
    progressed = False
    for key, prog in programs.items():
      while pcs[key] < len(prog):
        ev = prog[pcs[key]]
        if ev.kind == "wait":
          if any(sems.get((ev.rank, ev.tile, wg), 0) < ev.target
                 for wg in range(NUM_COMPUTE_WGS)):
            break
        elif ev.kind == "reduce":
          for slot in range(d - 1):
            if (ev.rank, slot, ev.tile) not in landed:
              raise RuntimeError(f"rank {ev.rank} reads slot {slot} of tile {ev.tile} "
                                 "before it was written")
        elif ev.kind == "store" and ev.slot >= 0:
          # The store lands before its signal (wait_smem_to_gmem(0) precedes the signal).
          landed.add((ev.dst, ev.slot, ev.tile))
        elif ev.kind == "signal":
          for wg in range(NUM_COMPUTE_WGS):
            sems[(ev.dst, ev.tile, wg)] = sems.get((ev.dst, ev.tile, wg), 0) + 1
        trace.append(ev)
        pcs[key] += 1
        pending -= 1
        progressed = True
    if not progressed:
      stuck = {k: programs[k][pcs[k]] for k in programs if pcs[k] < len(programs[k])}
      raise RuntimeError(f"deadlock: {len(stuck)} CTAs blocked, e.g. {next(iter(stuck.values()))}")
  return {"semaphores": sems, "trace": trace}
