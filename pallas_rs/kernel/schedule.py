"""The communication schedule as data, shared by the kernel and the tests.

Every rank runs the same persistent loop over `num_devices * tiles_per_chunk` linear tile
indices, strided over its CTAs (CTA `c` of `num_ctas` takes `c, c + num_ctas, ...`). Linear
index `i` belongs to step `s = i // tiles_per_chunk` and tile `t = i % tiles_per_chunk` of that
step's chunk. At step `s` rank `r` computes the chunk of destination `(r - s - 1) % D`: the
previous rank first, its own chunk last (the stagger). A tile of a peer's chunk is TMA-stored
into the peer's receive slot `offset - 1`, where `offset = (dst - r) % D = D - 1 - s`, so slot `j`
of rank `r` holds the partial of source `(r - j - 1) % D`, and it is announced on the peer's
semaphore `(t, wg)` once the store has landed. An owner's partials therefore arrive from sources
`r + 1, r + 2, ..., r - 1` (slots D-2, ..., 0): NCCL's ring order (`ring_slots`), so that comm CTAs
can add them as they come in the unfused path's order (Config.tma_add at D > 2). The own
chunk's epilogue waits for `D - 1` signals on `(t, wg)`, then sums the slots in ring order and
adds its own partial last (Config.owner_sum). With `interleave` (Config.interleave_steps, the
default where a chunk is one row of CTA tiles) the remote steps are walked tile by tile
instead, step fastest, and the own step still last (`step_and_tile`): same events, another
order.

A signal for a remote tile is sent lazily: at the start of the epilogue of the CTA's next tile
(the store has had a whole mainloop to land), or after the loop for the CTA's last tile. The
last `eager_signal_steps` remote steps instead wait for their store right away and signal at
once (`first_eager_step`): the owner, who computes its own chunk next, waits less.

With `comm_ctas` > 0 (kernel v3, docs/design.md section 3.2) the first `comm_ctas` CTAs of a
rank compute nothing: the compute CTAs (the others, renumbered from 0) store each remote tile
into the rank's own staging slot `s` (the step) and flag it (lazily or eagerly, as above). Push:
the flag is local and comm CTA `c` of the source takes the tiles `c, c + comm_ctas, ...` of each
remote step in order, copies each into the owner's receive slot and announces landed tiles in
batches (`COMM_SIGNAL_LAG` tiles behind, `COMM_SIGNAL_BATCH` per signal) on the owner's counter
`(slot, c)`. Pull: the flag goes to the owner, whose comm CTA `c` copies the tiles from the
source's staging into its own slot (or, with `ring_chain`, stores the first into the output, or
into slot 0 with fp32 partials, and TMA-adds the others onto it, in ring order) and announces
them locally, in the same batches; a done handshake keeps every rank alive until its peers
have finished reading its staging buffer.

`SemLayout` names the semaphores; simulator.py runs the schedule as data and checks every
variant.

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
  staging), or, with `pull` or `owner_pull`, the peer's that computed this rank's chunk at
  `step` (signalled over NVLink); then `done()` counts the peers done reading this rank's
  staging buffer.
  """
  num_devices: int
  tiles: int
  comm_ctas: int
  pull: bool = False
  owner_pull: bool = False  # comm_mode "owner": staged flags and done, no delivered counters

  @property
  def shape(self) -> tuple[int, int]:
    if not self.comm_ctas and not self.owner_pull:
      return 1, self.tiles
    rows = 2 * (self.num_devices - 1) + (1 if self.pull or self.owner_pull else 0)
    return rows, max(self.tiles, self.comm_ctas)

  def done(self):
    """Pull, owner pull: the peers' warpgroups that finished reading this rank's staging."""
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


def interleave_pays(chunk: int, cta_tile_m: int, num_devices: int, group: int = 1) -> bool:
  """Whether the interleaved walk (step_and_tile) is the default: D > 2 and a step of one row
  of CTA tiles (a chunk, or with pairs two), where the step-major walk sweeps all of w in
  every wave (a D = 8 M = 512 rank's GEMM core with 64-row tiles 17-22% faster alone; two or
  more rows: no gain; BUILD_NOTES 2026-12-01, eighth session)."""
  return num_devices > 2 and group * chunk == cta_tile_m


def chunk_group(chunk: int, tile_m: int, wg_along_m: bool, num_devices: int) -> int:
  """Row chunks one CTA tile spans: 2 where the CTA tile is two chunks high ("pairs": a
  128-row tile over the 64-row chunks of ranks 2p and 2p + 1, D = 8 at M = 512; D even), else
  1. With the warpgroups stacked along M each warpgroup's tile is one chunk; side by side along
  N each warpgroup's tile spans both, one half per chunk (`half_dst`), which must hold whole
  64-row row blocks (wgmma, epilogue sub-tiles): tile_m 128 over 64-row chunks."""
  cta_m = 2 * tile_m if wg_along_m else tile_m
  halves_fit = wg_along_m or chunk % 64 == 0
  return 2 if cta_m == 2 * chunk and halves_fit and num_devices % 2 == 0 else 1


def num_steps(num_devices: int, group: int = 1) -> int:
  """Steps of a rank's walk: one per chunk group, its own group last."""
  return num_devices // group


def tile_grid(chunk: int, n: int, cta_m: int, cta_n: int, group: int = 1) -> tuple[int, int]:
  """(row blocks, column blocks) of CTA tiles over one step's rows (a chunk, or `group`
  chunks: pairs) and n columns."""
  return group * chunk // cta_m, n // cta_n


def snake_tile(lin: int, grid: tuple[int, int], minor_dim: int, width: int) -> tuple[int, int]:
  """(row block, column block) of tile `lin` of a `grid` in the kernel's order: Mosaic GPU's
  `planar_snake` (bands `width` tiles wide along `minor_dim`, 0 = M, 1 = N, walked across the
  other dimension, every other band reversed; the last band takes what is left), in Python."""
  major_size, minor_size = grid[1 - minor_dim], grid[minor_dim]
  band = lin // (width * major_size)
  full = minor_size // width
  if band < full:
    rest, band_width = lin, width
  else:
    rest, band_width = lin - full * width * major_size, minor_size - full * width
  minor = band * width + rest % band_width
  major = rest // band_width % major_size
  if band % 2:
    major = major_size - 1 - major
  return (minor, major) if minor_dim == 0 else (major, minor)


def wave_footprint(grid: tuple[int, int], cta_m: int, cta_n: int, minor_dim: int, width: int,
                   num_ctas: int) -> int:
  """What the first wave of a step (its first `num_ctas` tiles) reads, per element of
  k_shard: rows of x plus columns of w. The tile order that keeps it small keeps a wave's
  operands in L2 (BUILD_NOTES 2026-12-01, eleventh session)."""
  tiles = [snake_tile(i, grid, minor_dim, width) for i in range(min(num_ctas, grid[0] * grid[1]))]
  return len({m for m, _ in tiles}) * cta_m + len({n for _, n in tiles}) * cta_n


def total_tiles(chunk: int, n: int, cta_m: int, cta_n: int, num_devices: int,
                group: int = 1) -> int:
  """Linear tiles of a rank's walk: num_steps x one step's tile_grid."""
  m_iters, n_iters = tile_grid(chunk, n, cta_m, cta_n, group)
  return num_steps(num_devices, group) * m_iters * n_iters


def wg_dst(rank: Any, step: Any, wg: Any, num_devices: int, group: int = 1) -> Any:
  """Destination rank of warpgroup `wg`'s tile at `step`: chunk group (rank // g - step - 1)
  mod D / g (the stagger), and in it the warpgroup's own chunk (g = 2) or the group's one
  chunk (g = 1, both warpgroups: `(rank - step - 1) % D`)."""
  groups = num_devices // group
  first = (rank // group - step - 1) % groups * group
  return first + wg if group == 2 else first


def half_dst(rank: Any, step: Any, half: int, num_devices: int) -> Any:
  """Pairs with the warpgroups along N: the destination of rows 64 half .. 64 half + 63 of a
  warpgroup's tile (both warpgroups' tiles span the pair's two chunks): the chunk that
  `wg_dst` gives warpgroup `half` of the same CTA tile with the warpgroups along M. Every
  element goes where it goes with the M split, in the same arithmetic; a warpgroup's tile has
  a destination per half instead of one."""
  return wg_dst(rank, step, half, num_devices, 2)


def wg_offset(rank: Any, step: Any, wg: Any, num_devices: int, group: int = 1) -> Any:
  """Offset of `wg_dst` from `rank` (0: the own chunk; o > 0: receive slot o - 1)."""
  return (wg_dst(rank, step, wg, num_devices, group) - rank) % num_devices


def recv_slot(offset: Any) -> Any:
  """The owner's receive slot of a partial from the source `offset` ranks before it (the
  destination's offset from the source): slot j holds source (owner - j - 1) % D."""
  return offset - 1


def dst_offset(step: int, num_devices: int) -> int:
  """Offset from a rank of the peer whose chunk it computes at remote `step` (g = 1)."""
  return num_devices - 1 - step


def remote_step(offset: Any, num_devices: int) -> Any:
  """The step at which a rank computes the chunk of the peer `offset` ranks after it (g = 1;
  with pairs, the same order by chunk): the peer at offset D - 1 first, offset 1 last."""
  return num_devices - 1 - offset


def arrival_slot(step: int, num_devices: int) -> int:
  """The owner's receive slot of the partial it gets at remote `step` (from source owner +
  step + 1: recv_slot(D - source_offset(step))); its own inverse, so also the step at which
  slot j's source computed the owner's chunk."""
  return num_devices - 2 - step


def source_offset(step: int) -> int:
  """Offset from an owner of the source that computes the owner's chunk at its remote `step`
  (the owner's step-th arrival; step s comes from source owner + s + 1: ring order)."""
  return step + 1


def source_of_slot(rank: int, slot: int, num_devices: int) -> int:
  return (rank - slot - 1) % num_devices


def ring_slots(num_devices: int) -> tuple[int, ...]:
  """Receive slots in NCCL's ring order for owner_sum="bf16_ring": the unfused reduce-scatter
  of chunk r adds the partials of sources r+1, r+2, ..., r+D-1 (the first one is the initial
  running sum), then r's own; source r+i sits in slot D-1-i (source_of_slot) and arrives at
  step i - 1 (the stagger), so ring order is arrival order."""
  return tuple(range(num_devices - 2, -1, -1))


def own_step(num_devices: int) -> int:
  return num_devices - 1


def first_eager_step(num_devices: int, eager_signal_steps: int) -> int:
  """Remote steps >= this signal eagerly; own_step (no remote step) when none does."""
  return max(0, own_step(num_devices) - eager_signal_steps)


def pull_done_target(num_devices: int, readers: int) -> int:
  """Pull: the "done" signals a rank waits for before it exits, one from each reading
  warpgroup of each peer (its `readers` comm CTAs, or with comm_mode "owner" its compute CTAs),
  once that warpgroup has finished reading the rank's staging buffer."""
  return (num_devices - 1) * readers * NUM_COMPUTE_WGS


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
