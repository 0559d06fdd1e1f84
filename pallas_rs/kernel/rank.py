"""One rank's kernel as data: the timing hooks and the facts of a call, decided once by
body.kernel_body and read by its phases (the tile loop in body.py, the epilogues in
epilogue.py)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_rs.kernel import schedule
from pallas_rs.kernel.config import Config
from pallas_rs.kernel.config import MatmulDimension

# Stages a timing run may leave out (kernel_body's `skip`; Hooks says what each does).
ABLATIONS = frozenset({"comm", "reduce", "gemm", "stage_wait", "recv_store", "owner_wait",
                       "comm_signal", "owner_add", "store"})


@dataclasses.dataclass(frozen=True)
class Hooks:
  """The ablation hooks in one place: which stages run (all, except for timing; the output is
  then wrong). comm: peer tiles stay local (this rank's own receive slots, output or staging),
  no pushes, signals or waits; reduce: the owner's loads and adds of received partials (with
  sum_in_output: its add; the own partial is stored); gemm: the mainloop (epilogues of tiles of
  zeros: the data movement alone); stage_wait: the comm CTAs' wait for a staged tile;
  recv_store: a pulling comm CTA's store of what it pulled; owner_wait: the owner's wait for
  its partials; owner_add: the owner's register reads and adds of the partials it loaded;
  comm_signal (only without owner_wait): the comm CTAs' landed signals; store: the epilogues'
  TMA stores of finished tiles (output, partials, staging) and their waits for SMEM slots:
  each sub-tile is written to SMEM and dropped there (without that write Pallas drops the
  tile's wgmmas: an H100 ran 1.17 PFLOP/s)."""
  comm: bool = True
  reduce: bool = True
  gemm: bool = True
  stage_wait: bool = True
  recv_store: bool = True
  owner_wait: bool = True
  comm_signal: bool = True
  owner_add: bool = True
  store: bool = True

  @classmethod
  def skipping(cls, skip: frozenset[str]) -> "Hooks":
    assert skip <= ABLATIONS, skip
    assert "comm_signal" not in skip or "owner_wait" in skip, skip
    return cls(**{name: name not in skip for name in ABLATIONS})


@dataclasses.dataclass(frozen=True)
class Rank:
  """One rank's program of the D-device kernel: its config, where its buffers are and how its
  tiles are walked and moved. Per rank (transport.bind): x [m, k_shard], w [k_shard, n],
  out [m // D, n]; recv_local [D - 1, m // D, n] (receive slots, or None), stage_local
  [D - 1, m // D, n] (staged peer tiles, or None); the *_gmem / out_all fields are the unbound
  buffers, as transport.peer addresses them on other ranks."""
  config: Config
  d: int
  hooks: Hooks
  transport: Any
  rank: Any
  sems: Any  # transport.semaphores(where.shape); None at D = 1
  x: Any
  w: Any
  out: Any
  out_all: Any
  recv_gmem: Any
  recv_local: Any
  stage_gmem: Any
  stage_local: Any

  @property
  def group(self) -> int:
    """Chunks per CTA tile: 2 ("pairs") where a 128-row CTA tile spans two 64-row chunks
    (warpgroups along M: each warpgroup's tile is one chunk's; along N: split_halves)."""
    return self.config.chunk_group(self.x.shape[0], self.d)

  @property
  def m_iters(self) -> int:
    """CTA tiles per step along M."""
    return self._grid[0]

  @property
  def n_iters(self) -> int:
    """CTA tiles per step along N."""
    return self._grid[1]

  @property
  def _grid(self) -> tuple[int, int]:
    c = self.config
    return schedule.tile_grid(self.x.shape[0] // self.d, self.w.shape[1], c.cta_tile_m,
                              c.cta_tile_n, self.group)

  @property
  def num_comm(self) -> int:
    """Comm CTAs (none at D = 1)."""
    return self.config.comm_ctas if self.d > 1 else 0

  @property
  def part_dtype(self):
    """The dtype partials travel in (the output's at D = 1, where none do)."""
    return jnp.dtype(self.config.partial_dtype) if self.d > 1 else self.out.dtype

  @property
  def where(self) -> schedule.SemLayout:
    """Where each semaphore of this kernel lives."""
    return schedule.SemLayout(self.d, self.tiles, self.num_comm, self.pull, self.owner_pull)

  @property
  def tiles(self) -> int:
    return self.m_iters * self.n_iters

  @property
  def pairs(self) -> bool:
    return self.group == 2

  @property
  def split_halves(self) -> bool:
    """Pairs with the warpgroups along N: each warpgroup's tile has two destinations, one per
    64-row half (schedule.half_dst); along M each warpgroup's tile is one chunk."""
    return self.pairs and not self.wg_m

  @property
  def part_m(self) -> int:
    """Rows of one destination's part of a warpgroup tile (a half with split_halves)."""
    return self.config.tile_m // 2 if self.split_halves else self.config.tile_m

  def parts(self, step, wg_idx) -> list[tuple[Any, Any]]:
    """(rows of the warpgroup tile, offset of their destination from this rank) per part of
    warpgroup `wg_idx`'s tile at `step`: the whole tile (rows None), or (split_halves) each
    half."""
    if self.split_halves:
      return [(slice(h * self.part_m, (h + 1) * self.part_m),
               (schedule.half_dst(self.rank, step, h, self.d) - self.rank) % self.d)
              for h in range(2)]
    return [(None, schedule.wg_offset(self.rank, step, wg_idx, self.d, self.group))]

  @property
  def steps(self) -> int:
    return schedule.num_steps(self.d, self.group)

  @property
  def pull(self) -> bool:
    """Pulling comm CTAs (the owner's) move the staged tiles."""
    return bool(self.num_comm) and self.config.comm_mode == "pull"

  @property
  def owner_pull(self) -> bool:
    """comm_mode "owner": the owner's compute CTAs load the staged tiles (no comm CTAs)."""
    return self.d > 1 and self.config.comm_mode == "owner"

  @property
  def staging(self) -> bool:
    """Remote tiles go to this rank's staging buffer (comm CTAs or "owner" move them on)."""
    return bool(self.num_comm) or self.owner_pull

  @property
  def sum_in_output(self) -> bool:
    """The peers' bf16 partials land in the owner's output, which TMA-adds its own onto them."""
    return self.config.sum_in_output and self.d > 1

  @property
  def sum_slot(self) -> bool:
    """Pulling comm CTAs TMA-add the peers' fp32 partials into receive slot 0, in ring order."""
    return self.config.sum_slot and self.d > 1

  @property
  def ring(self) -> bool:
    return self.config.owner_sum == "bf16_ring" and self.d > 1

  @property
  def slot_order(self) -> tuple[int, ...]:
    """The receive slots the owner loads, in the order it adds them: NCCL's ring order (every
    owner sum), or the one slot holding the peers' sum (sum_slot)."""
    return (0,) if self.sum_slot else schedule.ring_slots(self.d)

  @property
  def first_eager(self) -> int:
    return schedule.first_eager_step(self.d, self.config.eager_signal_steps)

  @property
  def spread(self) -> bool:
    """Config.spread_stores where it runs: with the mainloop (over whose blocks the stores
    leave) and the stores (hooks)."""
    return self.config.spread_stores and self.hooks.gemm and self.hooks.store

  @property
  def wg_m(self) -> bool:
    return self.config.wg_dimension == MatmulDimension.M

  @property
  def epi_tiles(self) -> list[tuple[int, int]]:
    """(row, column) of each epilogue sub-tile of a warpgroup tile, in store order."""
    c = self.config
    return [(mi, ni) for mi in range(self.part_m // c.epi_tile_m)
            for ni in range(c.tile_n // c.epi_tile_n)]

  def epi_slices(self, mi: int, ni: int):
    m, n = self.config.epi_tile_m, self.config.epi_tile_n
    return slice(mi * m, (mi + 1) * m), slice(ni * n, (ni + 1) * n)

  def walk(self, lin):
    """(step, tile) of linear index `lin` of this rank's walk (schedule.step_and_tile)."""
    return schedule.step_and_tile(lin, self.tiles, self.steps, self.config.interleave_steps)

  def tile_slices(self, tile, wg_idx):
    """((m_idx, n_idx), slices): the tile's row and column block and the rows and columns of
    warpgroup `wg_idx`'s part of it, within a [chunk, n] array (with split_halves: of each
    half, in its destination's chunk)."""
    c = self.config
    m_idx, n_idx = plgpu.planar_snake(tile, (self.m_iters, self.n_iters), c.grid_minor_dim,
                                      c.grid_tile_width)
    row0, col0 = m_idx * c.cta_tile_m, n_idx * c.cta_tile_n
    if self.wg_m and not self.pairs:
      row0 += wg_idx * c.tile_m
    elif not self.wg_m:
      col0 += wg_idx * c.tile_n
    return (m_idx, n_idx), (pl.ds(row0, self.part_m), pl.ds(col0, c.tile_n))
